//! A layer sink that streams to files the way a real store would: into a
//! `.partial` file, renamed into place on `finish`, deleted on `abort`. It
//! counts what it was given so tests can tell what was fetched.

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use runbox_image::pull::{LayerInfo, LayerSink, LayerWriter, ProgressEvent};

#[derive(Default, Debug)]
pub struct Counts {
    /// Bytes written to any writer.
    pub bytes: u64,
    /// Digests begun, in order.
    pub begun: Vec<String>,
    /// Digests committed, in order.
    pub finished: Vec<String>,
    /// Digests aborted.
    pub aborted: Vec<String>,
}

pub struct DirSink {
    dir: PathBuf,
    pub counts: Arc<Mutex<Counts>>,
}

impl DirSink {
    pub fn new(dir: &Path) -> Self {
        std::fs::create_dir_all(dir.join("layers")).unwrap();
        std::fs::create_dir_all(dir.join("tmp")).unwrap();
        Self {
            dir: dir.to_path_buf(),
            counts: Arc::default(),
        }
    }

    pub fn final_path(&self, digest: &str) -> PathBuf {
        self.dir.join("layers").join(digest.replace(':', "-"))
    }

    /// The committed layer, if any.
    pub fn layer(&self, digest: &str) -> Option<Vec<u8>> {
        std::fs::read(self.final_path(digest)).ok()
    }

    /// Names of everything in the sink's directories (committed and not).
    pub fn files(&self) -> Vec<String> {
        let mut names = Vec::new();
        for sub in ["layers", "tmp"] {
            for e in std::fs::read_dir(self.dir.join(sub)).unwrap() {
                names.push(format!(
                    "{sub}/{}",
                    e.unwrap().file_name().to_string_lossy()
                ));
            }
        }
        names.sort();
        names
    }

    pub fn counts(&self) -> std::sync::MutexGuard<'_, Counts> {
        self.counts.lock().unwrap()
    }
}

impl LayerSink for DirSink {
    fn has_layer(&self, layer: &LayerInfo) -> bool {
        self.final_path(&layer.digest).exists()
    }

    fn begin(&self, layer: &LayerInfo) -> io::Result<Box<dyn LayerWriter>> {
        let tmp = self
            .dir
            .join("tmp")
            .join(format!("{}.partial", layer.digest.replace(':', "-")));
        self.counts.lock().unwrap().begun.push(layer.digest.clone());
        Ok(Box::new(DirWriter {
            file: File::create(&tmp)?,
            tmp,
            dest: self.final_path(&layer.digest),
            digest: layer.digest.clone(),
            counts: self.counts.clone(),
        }))
    }
}

struct DirWriter {
    file: File,
    tmp: PathBuf,
    dest: PathBuf,
    digest: String,
    counts: Arc<Mutex<Counts>>,
}

impl LayerWriter for DirWriter {
    fn write(&mut self, chunk: &[u8]) -> io::Result<()> {
        self.counts.lock().unwrap().bytes += chunk.len() as u64;
        self.file.write_all(chunk)
    }

    fn finish(self: Box<Self>) -> io::Result<()> {
        self.file.sync_all()?;
        std::fs::rename(&self.tmp, &self.dest)?;
        self.counts
            .lock()
            .unwrap()
            .finished
            .push(self.digest.clone());
        Ok(())
    }

    fn abort(self: Box<Self>) {
        let _ = std::fs::remove_file(&self.tmp);
        self.counts
            .lock()
            .unwrap()
            .aborted
            .push(self.digest.clone());
    }
}

/// Collects progress events.
#[derive(Default)]
pub struct Progress(pub Mutex<Vec<ProgressEvent>>);

impl Progress {
    pub fn callback(&self) -> impl Fn(ProgressEvent) + Send + Sync + '_ {
        move |e| self.0.lock().unwrap().push(e)
    }

    pub fn events(&self) -> Vec<ProgressEvent> {
        self.0.lock().unwrap().clone()
    }
}
