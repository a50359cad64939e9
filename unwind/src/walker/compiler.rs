//! Compiles unwind tables away from the sample reader: a small pool of
//! threads, fed through a bounded queue, backed by an on-disk cache so a
//! restarted agent does not compile again.
//!
//! The queue hands out the object with the least mapped code first (but
//! one that [`MAX_PASSED`] others went before goes next), and at most all
//! threads but one compile a large object at a time: on a build
//! machine the table of a compiler's 100 MB driver takes seconds (more
//! under load), and the small programs sampled meanwhile, most of what a
//! node runs, must not wait behind it (their samples are held until their
//! tables are ready, and dropped from the queue beyond its bound).
//!
//! The cache holds one file per object, named by its identity (build-id and
//! content digest, or file key) and written atomically (temporary file,
//! then rename); the temporary files of an agent killed mid-write are
//! removed at the next start. The file format is `stackscope-unwind`'s: versioned and
//! checksummed, so a corrupt, cut short or outdated file is compiled again
//! and overwritten, never trusted. The directory is bounded in bytes:
//! reading a file refreshes its mtime, and after each write the least
//! recently used files go until it fits.

use std::{
    path::{Path, PathBuf},
    sync::{
        Arc, Condvar, Mutex, PoisonError,
        mpsc::{self, Receiver},
    },
};

use crate::{TableError, UnwindTable, table::DirectCfi};
use stackscope_process_table::{MappedObject, ObjectId};

/// Objects queued for compilation at most; beyond, the request is refused
/// and retried with a later sample.
const COMPILE_QUEUE: usize = 256;

/// What the compiler made of one object.
pub(super) enum Compiled {
    Table {
        table: Arc<UnwindTable>,
        /// Read back from the on-disk cache rather than compiled.
        from_disk: bool,
    },
    /// No usable CFI (none at all, or malformed): frame pointers.
    NoCfi,
    /// The file could not be opened or mapped (the process exited first);
    /// worth retrying with a later sample.
    Unreadable,
}

/// Where compiled tables are kept on disk, and how much room they may take.
#[derive(Debug, Clone)]
pub struct DiskCache {
    pub dir: PathBuf,
    pub max_bytes: u64,
}

/// Mapped code (the executable mapping's length) from which an object is
/// large: a compiler's driver, a browser, a JVM. Below, a table compiles in
/// milliseconds.
const LARGE_OBJECT_BYTES: u64 = 16 << 20;

/// Objects others may pass in the queue before the one waiting longest
/// goes next whatever its size: under a steady stream of small programs
/// (a build), a larger table is late, not never compiled.
const MAX_PASSED: u64 = 64;

/// The objects waiting, and how many large ones are compiling.
#[derive(Default)]
struct Queue {
    /// Oldest first, each with [`Queue::taken`] when it came.
    waiting: Vec<(MappedObject, u64)>,
    /// Objects taken so far.
    taken: u64,
    large_compiling: usize,
    /// How many large ones may compile at once: all threads but one, when
    /// there are two or more.
    max_large: usize,
    closed: bool,
}

fn code_bytes(object: &MappedObject) -> u64 {
    let mapping = &object.region.mapping;
    mapping.end.saturating_sub(mapping.start)
}

impl Queue {
    fn push(&mut self, object: MappedObject) {
        self.waiting.push((object, self.taken));
    }

    /// The object a free thread compiles next: the one with the least code
    /// (the oldest of equals), or the oldest once [`MAX_PASSED`] others
    /// went before it, unless it is large and `max_large` large ones are
    /// compiling already. The caller reports the end of a large one with
    /// [`Queue::large_done`].
    fn take(&mut self) -> Option<MappedObject> {
        let large_may_go = self.large_compiling < self.max_large.max(1);
        let may_go = |bytes| bytes < LARGE_OBJECT_BYTES || large_may_go;
        let (oldest, came) = self.waiting.first()?;
        let oldest_bytes = code_bytes(oldest);
        let (index, bytes) = if self.taken - came >= MAX_PASSED && may_go(oldest_bytes) {
            (0, oldest_bytes)
        } else {
            self.waiting
                .iter()
                .map(|(object, _)| code_bytes(object))
                .enumerate()
                .min_by_key(|&(index, bytes)| (bytes, index))
                .filter(|&(_, bytes)| may_go(bytes))?
        };
        if bytes >= LARGE_OBJECT_BYTES {
            self.large_compiling += 1;
        }
        self.taken += 1;
        Some(self.waiting.remove(index).0)
    }

    fn large_done(&mut self) {
        self.large_compiling = self.large_compiling.saturating_sub(1);
    }
}

/// The queue and the condition its threads wait on.
type Shared = (Mutex<Queue>, Condvar);

fn lock(shared: &Shared) -> std::sync::MutexGuard<'_, Queue> {
    shared.0.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A pool of compile threads. Dropping it closes the queue; the threads end
/// after their current object.
pub(super) struct Compiler {
    queue: Arc<Shared>,
    threads: usize,
    results: Receiver<(ObjectId, Compiled)>,
}

impl Compiler {
    /// Starts `threads` compile threads (at least one); the disk cache's
    /// directory, when given, is created if needed.
    pub(super) fn start(threads: usize, disk_cache: Option<DiskCache>) -> Self {
        let (done, results) = mpsc::channel();
        if let Some(cache) = &disk_cache {
            match std::fs::create_dir_all(&cache.dir) {
                Ok(()) => remove_abandoned_temporaries(&cache.dir),
                Err(err) => tracing::warn!("table cache {} unusable: {err}", cache.dir.display()),
            }
        }
        let queue: Arc<Shared> = Arc::default();
        let disk_cache: Option<Arc<DiskCache>> = disk_cache.map(Arc::new);
        let mut started: usize = 0;
        for n in 0..threads.max(1) {
            let queue = Arc::clone(&queue);
            let done = done.clone();
            let disk_cache = disk_cache.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("table-compiler-{n}"))
                .spawn(move || {
                    while let Some(object) = next_object(&queue) {
                        let compiled = {
                            let _slot = (code_bytes(&object) >= LARGE_OBJECT_BYTES)
                                .then(|| LargeSlot(&queue));
                            compile_guarded(&object, disk_cache.as_deref())
                        };
                        if done.send((*object.id, compiled)).is_err() {
                            break;
                        }
                    }
                });
            match spawned {
                Ok(_) => started += 1,
                Err(err) => tracing::warn!("could not start a table compiler thread: {err}"),
            }
        }
        // One thread stays free for small objects, when there are two.
        lock(&queue).max_large = started.saturating_sub(1).max(1);
        Self {
            queue,
            threads: started,
            results,
        }
    }

    /// Queues `object`; false when the queue is full (or no thread runs).
    pub(super) fn submit(&self, object: MappedObject) -> bool {
        if self.threads == 0 {
            return false;
        }
        {
            let mut queue = lock(&self.queue);
            if queue.waiting.len() >= COMPILE_QUEUE {
                return false;
            }
            queue.push(object);
        }
        // Any waiting thread can take it, if any can.
        self.queue.1.notify_one();
        true
    }

    /// A finished object, if any.
    pub(super) fn finished(&self) -> Option<(ObjectId, Compiled)> {
        self.results.try_recv().ok()
    }
}

impl Drop for Compiler {
    fn drop(&mut self) {
        lock(&self.queue).closed = true;
        self.queue.1.notify_all();
    }
}

/// A large object compiling: its place among the large ones is given
/// back however the compile ends.
struct LargeSlot<'a>(&'a Shared);

impl Drop for LargeSlot<'_> {
    fn drop(&mut self) {
        lock(self.0).large_done();
        // A thread may be waiting for a large one.
        self.0.1.notify_one();
    }
}

/// [`compile`], with a panic on a hostile file (a parser bug) turned into
/// "no table" for that file instead of the end of a compile thread.
fn compile_guarded(object: &MappedObject, disk_cache: Option<&DiskCache>) -> Compiled {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| compile(object, disk_cache)))
        .unwrap_or_else(|_| {
            tracing::error!(
                "compiling the unwind table of {} panicked; using frame pointers",
                object.path()
            );
            Compiled::NoCfi
        })
}

/// Waits for an object this thread may compile; `None` once the pool is
/// dropped.
fn next_object(shared: &Shared) -> Option<MappedObject> {
    let mut queue = lock(shared);
    loop {
        if queue.closed {
            return None;
        }
        if let Some(object) = queue.take() {
            return Some(object);
        }
        queue = shared.1.wait(queue).unwrap_or_else(PoisonError::into_inner);
    }
}

/// The cache file of `id` in `dir`: by the build-id and the digest of the
/// file's contents, so a table compiled from a file that claimed another's
/// build-id is never read back for that other file, even after a restart.
fn cache_path(dir: &Path, id: &ObjectId) -> PathBuf {
    dir.join(format!("{}.table", id.unique_name()))
}

fn compile(object: &MappedObject, disk_cache: Option<&DiskCache>) -> Compiled {
    let cached = disk_cache.map(|cache| cache_path(&cache.dir, &object.id));
    if let Some(path) = &cached
        && let Ok(bytes) = std::fs::read(path)
    {
        match UnwindTable::from_bytes(&bytes) {
            Ok(table) => {
                // Recently used: the last file eviction takes.
                if let Ok(file) = std::fs::File::options().write(true).open(path) {
                    let _ = file.set_modified(std::time::SystemTime::now());
                }
                return Compiled::Table {
                    table: Arc::new(table),
                    from_disk: true,
                };
            }
            Err(err) => tracing::debug!(
                "recompiling {}: cache file {}: {err}",
                object.path(),
                path.display()
            ),
        }
    }

    let Some(bytes) = map_object(object) else {
        return Compiled::Unreadable;
    };
    let table = match UnwindTable::from_elf(&bytes) {
        Ok(table) => table,
        Err(TableError::NoCfi) => return Compiled::NoCfi,
        Err(err) => {
            tracing::warn!(
                "no unwind table for {}: {err}; using frame pointers",
                object.path()
            );
            return Compiled::NoCfi;
        }
    };
    if let (Some(path), Some(cache)) = (&cached, disk_cache) {
        write_atomically(path, &table.to_bytes());
        evict_least_recently_used(&cache.dir, cache.max_bytes);
    }
    Compiled::Table {
        table: Arc::new(table),
        from_disk: false,
    }
}

/// The file of `object`, mapped read-only; `None` when it cannot be
/// reached (its process exited first) or mapped.
fn map_object(object: &MappedObject) -> Option<memmap2::Mmap> {
    let opened = object
        .open()
        .map_err(|err| tracing::debug!("cannot open {}: {err}", object.path()))
        .ok()?;
    // SAFETY: a read-only private mapping, only read. A file truncated
    // underneath it could fault (SIGBUS), the accepted risk of every
    // mmap-based ELF reader: files mapped by running processes are not
    // truncated in practice.
    unsafe { memmap2::Mmap::map(&opened.file) }
        .map_err(|err| tracing::debug!("cannot map {}: {err}", object.path()))
        .ok()
}

/// For a large object (whose table takes seconds), its CFI read directly
/// meanwhile (see [`DirectCfi`]); `None` for a small one, or one whose
/// CFI cannot be read so.
pub(super) fn direct_cfi(object: &MappedObject) -> Option<Arc<DirectCfi>> {
    if code_bytes(object) < LARGE_OBJECT_BYTES {
        return None;
    }
    match DirectCfi::new(map_object(object)?) {
        Ok(direct) => Some(Arc::new(direct)),
        Err(err) => {
            tracing::debug!("{}: rules wait for its table: {err}", object.path());
            None
        }
    }
}

/// The temporary file `process` writes `path`'s new contents to.
fn temporary_path(path: &Path, process: u32) -> PathBuf {
    path.with_extension(format!("{TEMPORARY_EXTENSION}.{process}"))
}

/// What a temporary cache file's name has between the object and the
/// writer's process id: `<id>.tmp.<pid>`.
const TEMPORARY_EXTENSION: &str = "tmp";

/// Writes `bytes` to `path` so that a reader sees the old file or the whole
/// new one, never a partial write. Failures only cost a later recompile.
fn write_atomically(path: &Path, bytes: &[u8]) {
    let temporary = temporary_path(path, std::process::id());
    let result = std::fs::write(&temporary, bytes).and_then(|()| std::fs::rename(&temporary, path));
    if let Err(err) = result {
        tracing::debug!("not caching {}: {err}", path.display());
        let _ = std::fs::remove_file(&temporary);
    }
}

/// Removes the temporary files of agents that were killed (or lost power)
/// between writing a table and renaming it into place: nobody will rename
/// them, nothing reads them, and eviction counts only finished tables, so
/// without this each kill would leave one behind for good. Called before
/// this process writes any, so a file named with its own pid is a previous
/// agent's that had the same pid (a container's pid 1); a file whose writer
/// still runs (another agent sharing the directory) is left alone.
fn remove_abandoned_temporaries(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let writer = path
            .file_name()
            .and_then(|name| name.to_str())
            .and_then(|name| name.rsplit_once(&format!(".{TEMPORARY_EXTENSION}.")))
            .and_then(|(_, pid)| pid.parse::<u32>().ok());
        let Some(writer) = writer else { continue };
        let running =
            writer != std::process::id() && Path::new(&format!("/proc/{writer}")).exists();
        if running {
            continue;
        }
        match std::fs::remove_file(&path) {
            Ok(()) => tracing::debug!("removed {}, left by a stopped agent", path.display()),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
            Err(err) => tracing::debug!("cannot remove {}: {err}", path.display()),
        }
    }
}

/// Removes the least recently used cache files of `dir` until the rest take
/// at most `max_bytes`. Another thread may be evicting too: a file already
/// gone is simply skipped.
fn evict_least_recently_used(dir: &Path, max_bytes: u64) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut files: Vec<(std::time::SystemTime, u64, PathBuf)> = entries
        .flatten()
        .filter(|entry| entry.path().extension().is_some_and(|ext| ext == "table"))
        .filter_map(|entry| {
            let metadata = entry.metadata().ok()?;
            Some((metadata.modified().ok()?, metadata.len(), entry.path()))
        })
        .collect();
    let mut total: u64 = files.iter().map(|(_, len, _)| len).sum();
    files.sort();
    for (_, len, path) in files {
        if total <= max_bytes {
            break;
        }
        match std::fs::remove_file(&path) {
            Ok(()) => total -= len,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => total -= len,
            Err(err) => tracing::debug!("cannot evict {}: {err}", path.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use stackscope_process_table::{Location, ProcessTable};

    use super::*;

    /// An object of this very process: the test binary's own text.
    fn own_object() -> MappedObject {
        let mut processes = ProcessTable::default();
        let pc = own_object as fn() -> MappedObject as usize as u64;
        match processes.lookup(std::process::id(), pc) {
            Ok(Some(Location::Object(object))) => object,
            other => panic!("the test's own code is not an object: {other:?}"),
        }
    }

    fn wait(compiler: &Compiler) -> (ObjectId, Compiled) {
        let started = Instant::now();
        loop {
            if let Some(done) = compiler.finished() {
                return done;
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "no table compiled"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The test's own object, claiming `bytes` of mapped code (for the
    /// queue only: its file is not reachable at that size).
    fn object_of(bytes: u64) -> MappedObject {
        let mut object = own_object();
        let mut region = (*object.region).clone();
        region.mapping.end = region.mapping.start + bytes;
        object.region = Arc::new(region);
        object
    }

    #[test]
    fn the_least_code_goes_first_and_large_objects_leave_a_thread_free() {
        let large = LARGE_OBJECT_BYTES;
        let mut queue = Queue {
            max_large: 1,
            ..Queue::default()
        };
        for bytes in [2 * large, 3 * large, 4096, large - 1, 4096] {
            queue.push(object_of(bytes));
        }
        let taken = |queue: &mut Queue| queue.take().map(|object| code_bytes(&object));
        // Smallest first, the older of equals first.
        assert_eq!(taken(&mut queue), Some(4096));
        assert_eq!(queue.waiting.len(), 4);
        assert_eq!(taken(&mut queue), Some(4096));
        assert_eq!(taken(&mut queue), Some(large - 1));
        // One large one at a time (of two threads): the other waits.
        assert_eq!(taken(&mut queue), Some(2 * large));
        assert_eq!(taken(&mut queue), None);
        // A small one arriving meanwhile goes at once.
        queue.push(object_of(8192));
        assert_eq!(taken(&mut queue), Some(8192));
        queue.large_done();
        assert_eq!(taken(&mut queue), Some(3 * large));
        assert_eq!(taken(&mut queue), None);
        assert!(queue.waiting.is_empty());
    }

    #[test]
    fn an_object_passed_over_long_enough_goes_next_whatever_its_size() {
        let mut queue = Queue {
            max_large: 1,
            ..Queue::default()
        };
        let taken = |queue: &mut Queue| queue.take().map(|object| code_bytes(&object));
        let waiting_long = LARGE_OBJECT_BYTES - 1;
        queue.push(object_of(waiting_long));
        // A steady stream of smaller ones: each goes first, until the
        // first has been passed MAX_PASSED times.
        for _ in 0..MAX_PASSED {
            queue.push(object_of(4096));
            assert_eq!(taken(&mut queue), Some(4096));
        }
        queue.push(object_of(4096));
        assert_eq!(taken(&mut queue), Some(waiting_long));
        assert_eq!(taken(&mut queue), Some(4096));
        assert_eq!(taken(&mut queue), None);

        // A large one passed over while the large ones' places are full
        // lets the small ones by: a thread is never left idle.
        let large = LARGE_OBJECT_BYTES;
        queue.push(object_of(large));
        assert_eq!(taken(&mut queue), Some(large));
        queue.push(object_of(2 * large));
        for _ in 0..MAX_PASSED {
            queue.push(object_of(4096));
            assert_eq!(taken(&mut queue), Some(4096));
        }
        queue.push(object_of(4096));
        assert_eq!(taken(&mut queue), Some(4096));
        queue.large_done();
        assert_eq!(taken(&mut queue), Some(2 * large));
    }

    #[test]
    fn compiles_once_then_reads_the_disk_cache_and_rebuilds_a_corrupt_file() {
        let dir = tempfile::tempdir().unwrap();
        let object = own_object();
        let disk = DiskCache {
            dir: dir.path().to_path_buf(),
            max_bytes: u64::MAX,
        };
        let compiler = Compiler::start(1, Some(disk));

        assert!(compiler.submit(object.clone()));
        let (id, first) = wait(&compiler);
        assert_eq!(id, *object.id);
        let Compiled::Table {
            table: compiled,
            from_disk: false,
        } = first
        else {
            panic!("the first request must compile");
        };
        let file = cache_path(dir.path(), &id);
        assert!(file.exists(), "no cache file written");

        assert!(compiler.submit(object.clone()));
        let Compiled::Table {
            table: cached,
            from_disk: true,
        } = wait(&compiler).1
        else {
            panic!("the second request must come from the disk cache");
        };
        assert_eq!(*cached, *compiled);

        // A damaged file is not trusted: compiled again and rewritten.
        let mut bytes = std::fs::read(&file).unwrap();
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0xff;
        std::fs::write(&file, &bytes).unwrap();
        assert!(compiler.submit(object));
        let Compiled::Table {
            table: rebuilt,
            from_disk: false,
        } = wait(&compiler).1
        else {
            panic!("a corrupt cache file must be recompiled");
        };
        assert_eq!(*rebuilt, *compiled);
        assert_eq!(
            UnwindTable::from_bytes(&std::fs::read(&file).unwrap()).unwrap(),
            *compiled
        );
    }

    #[test]
    fn temporaries_of_stopped_writers_are_removed_at_start() {
        let dir = tempfile::tempdir().unwrap();
        let table = dir.path().join("abc.table");
        std::fs::write(&table, b"kept").unwrap();
        // A child that has exited and been reaped: its pid runs nothing.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let gone = child.id();
        child.wait().unwrap();
        let abandoned = temporary_path(&table, gone);
        // Before this process wrote any: a previous agent with the same pid.
        let same_pid = dir.path().join(format!("def.tmp.{}", std::process::id()));
        // Another agent sharing the directory, writing now.
        let live = dir.path().join("def.tmp.1");
        let other = dir.path().join("abc.tmp.notes");
        for path in [&abandoned, &same_pid, &live, &other] {
            std::fs::write(path, b"half a table").unwrap();
        }
        assert_eq!(abandoned, dir.path().join(format!("abc.tmp.{gone}")));

        let compiler = Compiler::start(
            1,
            Some(DiskCache {
                dir: dir.path().to_path_buf(),
                max_bytes: u64::MAX,
            }),
        );
        drop(compiler);
        assert!(!abandoned.exists(), "an abandoned temporary file stays");
        assert!(
            !same_pid.exists(),
            "a previous agent's file with our pid stays"
        );
        assert!(live.exists() && other.exists() && table.exists());
    }

    #[test]
    fn evicts_the_least_recently_used_files_beyond_the_bound() {
        let dir = tempfile::tempdir().unwrap();
        let now = std::time::SystemTime::now();
        // a.table is the oldest, c.table the newest; other files are not ours.
        for (name, age_secs) in [
            ("a.table", 30),
            ("b.table", 20),
            ("c.table", 10),
            ("notes.txt", 40),
        ] {
            let path = dir.path().join(name);
            std::fs::write(&path, [0u8; 100]).unwrap();
            let file = std::fs::File::options().write(true).open(&path).unwrap();
            file.set_modified(now - Duration::from_secs(age_secs))
                .unwrap();
        }
        evict_least_recently_used(dir.path(), 250);
        let mut left: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["b.table", "c.table", "notes.txt"]);
        evict_least_recently_used(dir.path(), 0);
        assert!(!dir.path().join("c.table").exists());
        assert!(dir.path().join("notes.txt").exists());
    }
}
