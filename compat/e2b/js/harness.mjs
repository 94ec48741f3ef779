// What the E2B compatibility test files share: a runbox daemon of their own
// (the TypeScript SDK's test helper) that the unmodified SDK is pointed at
// through its environment, and a sandbox that is killed whatever the test did.
import { after, before } from "node:test";

import { Sandbox } from "e2b";

import { Daemon } from "../../../sdks/typescript/test/daemon.mjs";

/// Starts a daemon for this file's tests; `keyPrefix` goes before the token
/// in E2B_API_KEY (E2B's own key shape is `e2b_` and hex). Returns a getter:
/// the daemon exists only once `before` has run.
export function useDaemon({ name, octet, keyPrefix = "", args = [] }) {
  let daemon;
  before(async () => {
    daemon = await Daemon.start({ name, octet, args });
    process.env.E2B_API_KEY = `${keyPrefix}${daemon.token}`;
    process.env.E2B_API_URL = daemon.url;
    process.env.E2B_SANDBOX_URL = daemon.url;
    process.env.E2B_VOLUME_API_URL = daemon.url;
  });
  after(() => daemon?.stop());
  return () => daemon;
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

export async function withSandbox(opts, body) {
  const sbx = await Sandbox.create({ timeoutMs: 300_000, ...opts });
  try {
    await body(sbx);
  } finally {
    await sbx.kill();
  }
}
