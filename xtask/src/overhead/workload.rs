//! The overhead benchmark's workloads: what runs alone, under stackscope and
//! under perf, one process or thread per CPU, for a fixed time, and how
//! much it got done (its units).
//!
//! - `busy`: busy.c, deep recursion into libc's qsort and printf; nearly
//!   every sample is a stack not seen before (units: recursions done).
//! - `xz`: one `xz -9` per CPU, the Debian program issue 39's first figures
//!   were measured on. It is the opposite case: shallow stacks that repeat,
//!   in a compressor whose match finder sweeps hundreds of MB between two
//!   ticks (units: MB of text compressed). Its input is generated while it
//!   runs, never repeated: a repeat within xz's 64 MiB window would
//!   compress as one long match, at another speed than the text before it.

use std::{
    io::{BufRead as _, Read as _},
    path::PathBuf,
    process::{Child, Command, Stdio},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use crate::bench::compile_fixture;

/// Which workload `cargo xtask bench overhead` runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WorkloadKind {
    Busy,
    Xz,
}

/// A workload ready to start.
pub(super) enum Workload {
    Busy(PathBuf),
    Xz,
}

/// Bytes the text generator writes to xz at a time.
const TEXT_CHUNK: usize = 64 << 10;

/// What one `xz -9` compressor allocates (xz(1): 674 MiB), with room.
const XZ_MEMORY: u64 = 700 << 20;

/// `MemAvailable` from /proc/meminfo, in bytes.
fn available_memory() -> anyhow::Result<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").context("reading /proc/meminfo")?;
    meminfo
        .lines()
        .find_map(|line| line.strip_prefix("MemAvailable:"))
        .and_then(|rest| rest.trim().strip_suffix("kB")?.trim().parse::<u64>().ok())
        .map(|kib| kib << 10)
        .context("no MemAvailable in /proc/meminfo")
}

impl Workload {
    /// Ready to run `threads` at a time.
    pub(super) fn prepare(kind: WorkloadKind, threads: usize) -> anyhow::Result<Self> {
        Ok(match kind {
            WorkloadKind::Busy => Workload::Busy(compile_fixture("busy")?),
            WorkloadKind::Xz => {
                let found = Command::new("xz").arg("--version").output();
                if !found.is_ok_and(|out| out.status.success()) {
                    bail!("the xz workload needs xz (Debian's xz-utils)");
                }
                let available = available_memory()?;
                let needed = threads as u64 * XZ_MEMORY;
                if available < needed {
                    bail!(
                        "the xz workload runs {threads} xz -9, {} MiB each, and the host has \
                         {} MiB available",
                        XZ_MEMORY >> 20,
                        available >> 20
                    );
                }
                Workload::Xz
            }
        })
    }

    /// What its units count, for the report.
    pub(super) fn units(&self) -> &'static str {
        match self {
            Workload::Busy(_) => "recursions",
            Workload::Xz => "MB compressed",
        }
    }

    /// Whether perf's samples can be graded as reaching the root: perf
    /// finds roots by name (`_start`), which Debian's stripped xz lacks.
    pub(super) fn perf_names_roots(&self) -> bool {
        matches!(self, Workload::Busy(_))
    }

    /// For the report's headings.
    pub(super) fn describe(&self, threads: usize) -> String {
        match self {
            Workload::Busy(_) => format!("busy.c with {threads} threads (one per CPU)"),
            Workload::Xz => format!("{threads} xz -9 -T1 of generated text (one per CPU)"),
        }
    }

    /// Starts it: `threads` of it for `seconds`.
    pub(super) fn start(&self, threads: usize, seconds: u64) -> anyhow::Result<Running> {
        match self {
            Workload::Busy(busy) => {
                let mut child = Command::new(busy)
                    .args([threads.to_string(), seconds.to_string()])
                    .stdout(Stdio::piped())
                    .spawn()
                    .context("starting the workload")?;
                // "ready" first: the threads run from here.
                let mut line = String::new();
                let stdout = child.stdout.as_mut().context("piped stdout")?;
                std::io::BufReader::new(stdout).read_line(&mut line)?;
                Ok(Running::Busy(child))
            }
            Workload::Xz => {
                let until = Instant::now() + Duration::from_secs(seconds);
                let mut running = Vec::with_capacity(threads);
                for seed in 0..threads as u64 {
                    let mut child = Command::new("xz")
                        .args(["-9", "-T1", "-c"])
                        .stdin(Stdio::piped())
                        .stdout(Stdio::null())
                        .spawn()
                        .context("starting xz")?;
                    let stdin = child.stdin.take().context("piped stdin")?;
                    let feeder = std::thread::spawn(move || feed_text(stdin, seed, until));
                    running.push((child, feeder));
                }
                Ok(Running::Xz(running))
            }
        }
    }
}

/// A started workload.
pub(super) enum Running {
    Busy(Child),
    /// Each xz with the thread writing its input.
    Xz(Vec<(Child, JoinHandle<std::io::Result<u64>>)>),
}

impl Running {
    /// The processes to profile.
    pub(super) fn pids(&self) -> Vec<u32> {
        match self {
            Running::Busy(child) => vec![child.id()],
            Running::Xz(running) => running.iter().map(|(child, _)| child.id()).collect(),
        }
    }

    /// Waits for it to end and returns the units it completed.
    pub(super) fn finish(self) -> anyhow::Result<f64> {
        match self {
            Running::Busy(mut child) => {
                let mut out = String::new();
                child
                    .stdout
                    .as_mut()
                    .context("stdout")?
                    .read_to_string(&mut out)?;
                child.wait()?;
                out.lines()
                    .find_map(|line| line.strip_prefix("units "))
                    .and_then(|n| n.trim().parse().ok())
                    .with_context(|| format!("the workload printed no units: {out:?}"))
            }
            Running::Xz(running) => {
                // Every xz waited for first: one that died says why (its
                // feeder then only saw a broken pipe), and none is left.
                let (children, feeders): (Vec<_>, Vec<_>) = running.into_iter().unzip();
                let statuses: Vec<_> = children.into_iter().map(|mut child| child.wait()).collect();
                let fed: Vec<_> = feeders.into_iter().map(JoinHandle::join).collect();
                for status in statuses {
                    let status = status.context("waiting for xz")?;
                    if !status.success() {
                        bail!("xz failed: {status}");
                    }
                }
                let mut bytes = 0;
                for fed in fed {
                    let fed = fed.map_err(|_| anyhow::anyhow!("a feeder of xz panicked"))?;
                    bytes += fed.context("writing xz's input")?;
                }
                Ok(bytes as f64 / 1e6)
            }
        }
    }
}

/// Writes generated text to `stdin` until `until`, then closes it (xz then
/// ends its stream and exits); the bytes written.
fn feed_text(mut stdin: impl std::io::Write, seed: u64, until: Instant) -> std::io::Result<u64> {
    let mut text = Text::new(seed);
    let mut chunk = Vec::with_capacity(TEXT_CHUNK + 32);
    let mut written = 0;
    while Instant::now() < until {
        text.fill(&mut chunk, TEXT_CHUNK);
        stdin.write_all(&chunk)?;
        written += chunk.len() as u64;
    }
    Ok(written)
}

/// xorshift64*: the text's choices, the same for a seed on every run.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(0x9e37_79b9_7f4a_7c15 ^ seed.wrapping_mul(0xd1b5_4a32_d192_ed03))
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// Words of 2-9 letters from a fixed vocabulary, picked at random and
/// skewed to the frequent ones as in prose, in lines of about 70
/// characters: text that compresses about as natural text does, never
/// repeating a long run.
struct Text {
    words: Vec<Vec<u8>>,
    rng: Rng,
    line: usize,
}

impl Text {
    const WORDS: usize = 4096;

    fn new(seed: u64) -> Self {
        // The vocabulary does not depend on the seed: xz's work per byte is
        // the same in every process.
        let mut vocabulary = Rng::new(u64::MAX);
        let words = (0..Self::WORDS)
            .map(|_| {
                let len = 2 + (vocabulary.next() % 8) as usize;
                (0..len)
                    .map(|_| b'a' + (vocabulary.next() % 26) as u8)
                    .collect()
            })
            .collect();
        Self {
            words,
            rng: Rng::new(seed),
            line: 0,
        }
    }

    /// Replaces `chunk`'s contents with at least `len` bytes of text.
    fn fill(&mut self, chunk: &mut Vec<u8>, len: usize) {
        chunk.clear();
        let words = Self::WORDS as u64;
        while chunk.len() < len {
            // The smaller of two draws: low indexes (frequent words) come
            // up more often.
            let index = (self.rng.next() % words).min(self.rng.next() % words);
            let word = &self.words[index as usize];
            chunk.extend_from_slice(word);
            self.line += word.len() + 1;
            if self.line >= 70 {
                chunk.push(b'\n');
                self.line = 0;
            } else {
                chunk.push(b' ');
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xz_compresses_what_it_was_fed_then_exits_and_is_reaped() {
        let running = Workload::Xz.start(1, 1).expect("xz starts");
        let pids = running.pids();
        assert_eq!(pids.len(), 1);
        let megabytes = running.finish().expect("xz ends well");
        assert!(megabytes > 0.0, "{megabytes} MB fed");
        assert!(
            !std::path::Path::new(&format!("/proc/{}", pids[0])).exists(),
            "xz was not reaped"
        );
    }

    #[test]
    fn text_is_words_in_lines_and_never_repeats_a_chunk() {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        let mut text = Text::new(0);
        text.fill(&mut a, TEXT_CHUNK);
        text.fill(&mut b, TEXT_CHUNK);
        assert!(a.len() >= TEXT_CHUNK && b.len() >= TEXT_CHUNK);
        // No run of the next chunk (which xz would still have in its
        // window) stands in the one before: a repeat would compress as one
        // long match.
        let repeated = b
            .chunks_exact(256)
            .filter(|run| a.windows(run.len()).any(|window| window == *run))
            .count();
        assert_eq!(repeated, 0, "runs of 256 bytes repeated");
        assert!(
            a.iter()
                .all(|&c| c.is_ascii_lowercase() || c == b' ' || c == b'\n')
        );
        let longest_line = a.split(|&c| c == b'\n').map(<[u8]>::len).max();
        assert!(longest_line.is_some_and(|len| len < 80), "{longest_line:?}");
        // Another process's text differs from the first byte on.
        let mut other = Vec::new();
        Text::new(1).fill(&mut other, TEXT_CHUNK);
        assert_ne!(a[..64], other[..64]);
    }
}
