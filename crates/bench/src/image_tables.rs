//! The images phase: which cases its three tables run, in which order, and
//! which row each row is compared with.
//!
//! 1. **unpack**: the generated layer unpacked by the image store, and by
//!    GNU tar, plain and gzip, each time into a new directory; rotated like
//!    every other phase.
//! 2. **start**: create + first exec from a busybox-only image and from
//!    busybox plus the generated layer, on every daemon; rotated.
//! 3. **pull**: on a daemon of its own, each round pulls its own variant of
//!    the large image (same files, other layer digests: see
//!    [`Fixture::write_variant`]) with no layer of it stored (fresh), starts
//!    a run from it, pulls it again under another name with every layer
//!    stored (cached), and starts a run from that. Images are deleted only
//!    after the last round, so that no pull follows a deletion (see
//!    [`images::unpack_once`] on why that matters). Not rotated: the cached
//!    pull needs the fresh one. Each pull's events are checked, so a "fresh"
//!    pull that skipped a layer, or a "cached" one that fetched one, stops
//!    the benchmark.
//!
//! It owns none of the resources: they are recorded in [`Bench`] as they
//! are made, and its cleanup removes them.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use runbox_types::PullEvent;

use crate::daemon::Daemon;
use crate::images::{self, Fixture, Format, Registry, Unpack};
use crate::report::{ImageReport, LayerShape, Role, Series, Table, TableSeries};
use crate::{create_first_exec, Bench, Case, ImagePlan, Plan};

impl Bench {
    /// Builds the fixtures and runs the images phase's tables.
    pub(crate) async fn images(
        &mut self,
        plan: &Plan,
        images: &ImagePlan,
        busybox: &[u8],
    ) -> anyhow::Result<ImageReport> {
        eprintln!(
            "runbox-bench: images: generating a {} MiB layer (plain and gzip) and two OCI layouts",
            images.mib
        );
        let started = Instant::now();
        let dir = self.work.join("images");
        let busybox = busybox.to_vec();
        let mib = images.mib;
        // Synced before anything is timed: the first iterations must not
        // pay for writing the fixtures back.
        let fixture = tokio::task::spawn_blocking(move || {
            let fixture = Fixture::build(&dir, mib, &busybox);
            rustix::fs::sync();
            fixture
        })
        .await
        .context("the fixture task failed")??;
        eprintln!(
            "runbox-bench: images: fixtures ready in {:.1?}",
            started.elapsed()
        );
        let shape = fixture.shape.clone();
        self.fixture = Some(Arc::new(fixture));
        check_space(&self.work, plan, images, &shape)?;
        std::fs::create_dir(self.work.join("unpack"))?;
        let mut tables = vec![self.unpack_table(images, &shape).await?];
        tables.push(self.start_table(plan, images).await?);
        if images.pull {
            tables.push(self.pull_table(plan, images).await?);
        }
        Ok(ImageReport {
            layer: shape,
            tables,
        })
    }

    async fn unpack_table(
        &mut self,
        images: &ImagePlan,
        shape: &LayerShape,
    ) -> anyhow::Result<Table> {
        // Each runbox row is compared with tar on the same blob.
        let cases = [
            (Unpack::AddLayer(Format::Plain), Some(2)),
            (Unpack::Unpacker, Some(2)),
            (Unpack::Tar(Format::Plain), None),
            (Unpack::AddLayer(Format::Gzip), Some(4)),
            (Unpack::Tar(Format::Gzip), None),
        ];
        let phase: Vec<Case> = cases.iter().map(|(how, _)| Case::Unpack(*how)).collect();
        let series = self
            .phase_by_case("unpack", &phase, images.warmup, images.iterations)
            .await?;
        let rows = series
            .into_iter()
            .zip(cases)
            .flat_map(|(case, (_, versus))| {
                case.into_iter().map(move |series| TableSeries {
                    series,
                    bytes: Some(shape.file_bytes),
                    versus,
                })
            })
            .collect();
        Ok(Table::new(
            "unpack",
            "Unpacking one layer",
            "The generated layer unpacked once into a fresh destination. runbox: \
             `Store::add_layer(digest, File)` into a fresh store (the daemon's import path: pick \
             the decompressor, unpack with every check, sha256 of the blob against its digest, \
             rename into place); `unpack_layer` alone is the same unpacker without the store \
             and the digest. Baseline: GNU `tar -xf` / `tar -xzf` (which runs `gzip -d` as a \
             second process) into a fresh directory. The blobs are in the page cache; nothing \
             is fsynced; `sync` runs after each iteration, untimed. Every iteration writes a \
             new tree and none is deleted before the end: on ext4 without a journal, files \
             created in the minute after thousands were deleted cost seconds more.",
            images.warmup,
            images.iterations,
            rows,
        ))
    }

    async fn start_table(&mut self, plan: &Plan, images: &ImagePlan) -> anyhow::Result<Table> {
        let (small, large) = {
            let fixture = self.fixture.as_ref().context("no image fixture")?;
            (fixture.small_layout.clone(), fixture.large_layout.clone())
        };
        for daemon in &self.daemons {
            for (name, layout) in [(images::SMALL_IMAGE, &small), (images::LARGE_IMAGE, &large)] {
                let started = Instant::now();
                daemon.import_file(name, layout).await?;
                eprintln!(
                    "runbox-bench: images: imported {name} into the {} daemon in {:.1?}",
                    daemon.runtime,
                    started.elapsed()
                );
            }
        }
        let cases: Vec<Case> = (0..self.daemons.len())
            .flat_map(|i| [Case::StartFrom(i, false), Case::StartFrom(i, true)])
            .collect();
        let series = self
            .phase_by_case("start", &cases, plan.warmup, images.start_iterations)
            .await?;
        // Each large-image row (total or part) is compared with the same
        // row of the small image on the same daemon, the case just before.
        let mut rows = Vec::new();
        let mut first_row_of_case = Vec::new();
        for (c, case_rows) in series.into_iter().enumerate() {
            first_row_of_case.push(rows.len());
            let large = matches!(cases[c], Case::StartFrom(_, true));
            for (k, series) in case_rows.into_iter().enumerate() {
                rows.push(TableSeries {
                    series,
                    bytes: None,
                    versus: large.then(|| first_row_of_case[c - 1] + k),
                });
            }
        }
        Ok(Table::new(
            "start",
            "Start cost against image size",
            "`POST /v1/runs` then exec `/bin/true` until its exit event (the DELETE is timed \
             apart, not in the total), from an image of only the busybox layer (small) and \
             from busybox plus the generated layer (large). Both were imported as OCI layouts \
             beforehand and share the busybox layer.",
            plan.warmup,
            images.start_iterations,
            rows,
        ))
    }

    async fn pull_table(&mut self, plan: &Plan, images: &ImagePlan) -> anyhow::Result<Table> {
        let runtime = plan.runtimes.first().context("no runtime")?.clone();
        let rounds = images.warmup + images.iterations;
        eprintln!("runbox-bench: images: starting docker-registry");
        self.registry = Some(Registry::start(&self.work.join("registry")).await?);
        let fixture = Arc::clone(self.fixture.as_ref().context("no image fixture")?);
        let variants = self.work.join("variants");
        std::fs::create_dir(&variants)?;
        let started = Instant::now();
        let mut references = Vec::new();
        for n in 1..=rounds as u32 {
            let (fixture, dir) = (Arc::clone(&fixture), variants.clone());
            let layout = tokio::task::spawn_blocking(move || fixture.write_variant(&dir, n))
                .await
                .context("the variant task failed")??;
            let registry = self.registry.as_ref().context("no registry")?;
            let tag = format!("{}:{n}", images::REPOSITORY);
            registry.push(&layout, &tag, &variants).await?;
            std::fs::remove_file(&layout)?;
            references.push(registry.reference(&tag));
        }
        eprintln!(
            "runbox-bench: images: pushed {rounds} variants of the large image with skopeo in {:.1?}",
            started.elapsed()
        );
        eprintln!("runbox-bench: images: starting runbox serve --runtime {runtime} for the pulls");
        self.pull_daemon = Some(Daemon::start(&plan.runbox, &plan.agent, &runtime).await?);
        let daemon = self.pull_daemon.as_mut().context("no pull daemon")?;

        let mut fresh = Vec::new();
        let mut cached = Vec::new();
        let mut from_fresh: Vec<Vec<Duration>> = vec![Vec::new(); 4];
        let mut from_cached: Vec<Vec<Duration>> = vec![Vec::new(); 4];
        let mut fetched = 0;
        let mut image_bytes = 0;
        let mut layers = 0;
        let started = Instant::now();
        for (round, reference) in references.iter().enumerate() {
            let context = || format!("pull table, round {round}");

            let start = Instant::now();
            let (image, events) = daemon.pull(reference, &format!("fresh-{round}")).await?;
            let fresh_took = start.elapsed();
            let (started_layers, skipped, bytes) = layer_counts(&events);
            ensure!(
                started_layers == image.layers.len() && skipped == 0,
                "the fresh pull fetched {started_layers} and skipped {skipped} of {} layers",
                image.layers.len()
            );
            (fetched, image_bytes, layers) = (bytes, image.size_bytes, image.layers.len());
            let fresh_run = create_first_exec(daemon, &image.name)
                .await
                .with_context(context)?;

            let start = Instant::now();
            let (image, events) = daemon.pull(reference, &format!("cached-{round}")).await?;
            let cached_took = start.elapsed();
            let (started_layers, skipped, _) = layer_counts(&events);
            ensure!(
                started_layers == 0 && skipped == image.layers.len(),
                "the cached pull fetched {started_layers} and skipped {skipped} of {} layers",
                image.layers.len()
            );
            let cached_run = create_first_exec(daemon, &image.name)
                .await
                .with_context(context)?;
            // As after every unpack: the next round starts without this
            // one's writeback.
            tokio::task::spawn_blocking(rustix::fs::sync).await?;

            if round >= images.warmup {
                fresh.push(fresh_took);
                cached.push(cached_took);
                for (into, run) in [(&mut from_fresh, fresh_run), (&mut from_cached, cached_run)] {
                    into[0].push(run.total);
                    for (k, (_, took)) in run.parts.into_iter().enumerate() {
                        into[k + 1].push(took);
                    }
                }
            }
            eprintln!(
                "runbox-bench: pull: round {}/{rounds} ({} warm-up), {:.0?}",
                round + 1,
                images.warmup,
                started.elapsed()
            );
        }
        // Only now, with every pull done, are images deleted: the first
        // delete of a variant leaves its layers (the other name uses them),
        // the second removes them, and is timed.
        let mut delete_image = Vec::new();
        for round in 0..rounds {
            daemon.delete_image(&format!("fresh-{round}")).await?;
            let start = Instant::now();
            daemon.delete_image(&format!("cached-{round}")).await?;
            if round >= images.warmup {
                delete_image.push(start.elapsed());
            }
            tokio::task::spawn_blocking(rustix::fs::sync).await?;
        }

        let series = |label: String, role: Role, samples: Vec<Duration>| Series {
            label,
            role,
            runtime: Some(runtime.clone()),
            samples,
        };
        let row = |series: Series, bytes: Option<u64>, versus: Option<usize>| TableSeries {
            series,
            bytes,
            versus,
        };
        let mut rows = vec![
            row(
                series(
                    "pull, fresh: every layer fetched and unpacked".to_owned(),
                    Role::Runbox,
                    fresh,
                ),
                Some(image_bytes),
                None,
            ),
            row(
                series(
                    "pull, cached: every layer already stored".to_owned(),
                    Role::Runbox,
                    cached,
                ),
                None,
                Some(0),
            ),
        ];
        let parts = ["POST /v1/runs", "first exec", "DELETE, not in the total"];
        let fresh_total = rows.len();
        for (what, samples, versus) in [
            ("freshly pulled image", from_fresh, None),
            ("image of the cached pull", from_cached, Some(fresh_total)),
        ] {
            for (k, samples) in samples.into_iter().enumerate() {
                let (label, role) = match k {
                    0 => (
                        format!("create + first exec, {what} ({runtime})"),
                        Role::Runbox,
                    ),
                    k => (format!("{} ({runtime})", parts[k - 1]), Role::Part),
                };
                rows.push(row(
                    series(label, role, samples),
                    None,
                    versus.map(|v| v + k),
                ));
            }
        }
        rows.push(row(
            series(
                "DELETE /v1/images of the last image using the layers (removes them)".to_owned(),
                Role::Reference,
                delete_image,
            ),
            None,
            None,
        ));
        Ok(Table::new(
            "pull",
            "Pulling from a registry on loopback",
            &format!(
                "`POST /v1/images/pull` from `docker-registry` on 127.0.0.1, until the `done` \
                 event, on a daemon of its own with runtime {runtime}, of the large image \
                 ({layers} gzip layers, {:.1} MB fetched when fresh, {:.1} MB of file data). \
                 Fresh: each round pulls its own variant of the image, whose gzip blobs differ \
                 from the other variants' only in the header's mtime field (same files, other \
                 digests), so no layer of it is stored and none was deleted just before. \
                 Cached: the same variant again under another name, every layer stored \
                 (manifest and config only). After each pull, create + first exec from the \
                 image it made. Not rotated; `sync` after each round, untimed. After all \
                 rounds, each variant's two images are deleted; the second DELETE, which \
                 removes the layers, is timed.",
                fetched as f64 / 1e6,
                image_bytes as f64 / 1e6,
            ),
            images.warmup,
            images.iterations,
            rows,
        ))
    }
}

/// Fails early when the work directory's filesystem cannot hold what the
/// phase keeps until the end: every unpacked tree (see
/// [`images::unpack_once`]), the daemons' copies of the large image, and per
/// pull round a variant in the registry and its layers in the store.
fn check_space(
    work: &Path,
    plan: &Plan,
    images: &ImagePlan,
    shape: &LayerShape,
) -> anyhow::Result<()> {
    // Unpacked, small files round up to whole blocks: about 15 % more.
    let tree = shape.plain_bytes + shape.plain_bytes / 6;
    let rounds = (images.warmup + images.iterations) as u64;
    let mut needed = rounds * 5 * tree + plan.runtimes.len() as u64 * tree;
    if images.pull {
        needed += rounds * (shape.gzip_bytes + tree) + 2 * shape.gzip_bytes;
    }
    let available = images::available_bytes(work)?;
    ensure!(
        available > needed + (1 << 30),
        "the images phase needs about {:.1} GB free under {} and finds {:.1} GB; lower \
         --image-iterations or --image-mib",
        (needed + (1 << 30)) as f64 / 1e9,
        work.display(),
        available as f64 / 1e9
    );
    Ok(())
}

/// How many layers a pull fetched and skipped, and the bytes it fetched.
fn layer_counts(events: &[PullEvent]) -> (usize, usize, u64) {
    let mut fetched = 0;
    let mut skipped = 0;
    let mut bytes = 0;
    for event in events {
        match event {
            PullEvent::LayerStarted { size, .. } => {
                fetched += 1;
                bytes += size;
            }
            PullEvent::LayerSkipped { .. } => skipped += 1,
            _ => {}
        }
    }
    (fetched, skipped, bytes)
}
