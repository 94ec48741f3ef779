// E2B's template build API, driven by the unmodified JavaScript SDK:
// a build with files, commands, a workdir and start/ready commands; a
// failure in E2B's words; tags; a background build.
import assert from "node:assert/strict";
import { mkdirSync, mkdtempSync, rmSync, symlinkSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, test } from "node:test";

import { Sandbox, Template } from "e2b";

import { sleep, useDaemon } from "../harness.mjs";

useDaemon({ name: "e2bjst", octet: 243 });

const unique = (prefix) => `${prefix}-${Math.random().toString(16).slice(2, 10)}`;

// Every context made here is removed after the file's tests, pass or fail.
const contexts = [];
after(() => contexts.forEach((dir) => rmSync(dir, { recursive: true, force: true })));

function context() {
  const dir = mkdtempSync(join(tmpdir(), "e2b-template-"));
  contexts.push(dir);
  mkdirSync(join(dir, "folder"));
  writeFileSync(join(dir, "folder", "test.txt"), "This is a test file.");
  symlinkSync("test.txt", join(dir, "folder", "symlink.txt"));
  return dir;
}

test("a template builds, and sandboxes start from it", async () => {
  const name = unique("jstpl");
  const logs = [];
  const template = Template({ fileContextPath: context() })
    .fromImage("base")
    .copy("folder/*", "folder")
    .runCmd("cat folder/test.txt")
    .setWorkdir("/app")
    .runCmd("touch made-in-app")
    .setStartCmd("echo started > /tmp/started", "[ -f /tmp/started ]");
  const info = await Template.build(template, name, { onBuildLogs: (entry) => logs.push(entry.message) });
  assert.equal(info.name, name);
  assert.ok(logs.some((m) => m.includes("This is a test file.")), logs.join("\n"));
  const sbx = await Sandbox.create(name, { timeoutMs: 120_000 });
  try {
    const run = async (cmd) => (await sbx.commands.run(cmd)).stdout.trim();
    assert.equal(await run("cat /home/user/folder/symlink.txt"), "This is a test file.");
    assert.equal(await run("ls /app"), "made-in-app");
    assert.equal(await run("cat /tmp/started"), "started");
  } finally {
    await sbx.kill();
  }
});

test("a failed command fails the build in E2B's words", async () => {
  const failing = Template().fromImage("base").runCmd("exit 7");
  await assert.rejects(Template.build(failing, unique("jsfail")), (e) => {
    assert.match(e.message, /failed to run command 'exit 7': command failed: exit status 7/);
    return true;
  });
});

test("tags, exists and a background build", async () => {
  const name = unique("jstags");
  assert.equal(await Template.exists(name), false);
  const info = await Template.buildInBackground(Template().fromImage("base").runCmd("sleep 1"), `${name}:v1`);
  let status = await Template.getBuildStatus(info);
  assert.equal(status.status, "building");
  for (let i = 0; i < 240 && status.status === "building"; i++) {
    await sleep(500);
    status = await Template.getBuildStatus(info);
  }
  assert.equal(status.status, "ready");
  assert.equal(await Template.exists(`${name}:v1`), true);
  const assigned = await Template.assignTags(`${name}:v1`, "prod");
  assert.deepEqual(assigned.tags, ["prod"]);
  const tags = (await Template.getTags(name)).map((t) => t.tag).sort();
  assert.deepEqual(tags, ["prod", "v1"]);
  await Template.removeTags(name, "prod");
  assert.deepEqual((await Template.getTags(name)).map((t) => t.tag), ["v1"]);
});
