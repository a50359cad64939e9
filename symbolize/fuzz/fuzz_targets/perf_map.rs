//! The perf map reader (and the jitdump reader behind it) on files that
//! grow with arbitrary bytes, as a JIT writes them between the agent's
//! reads: names or `[jit] <comm>`, never a panic, within a small byte
//! budget shared by two processes.
//!
//! The input is steps separated by 0xff bytes. A step's first byte says
//! which process (bit 0), which file (bit 1: the perf map, or the jitdump
//! file its maps point at) and whether the file is truncated first (bit 2);
//! the rest is appended to that file. After each step the sampling side
//! looks up the start address of the step's last line (a likely hit) and
//! address 0, a refresh interval later than the step before; the reader
//! answers what those lookups asked for, and both are looked up again.
#![no_main]

use std::{
    io::Write as _,
    path::{Path, PathBuf},
    sync::OnceLock,
    time::Instant,
};

use libfuzzer_sys::fuzz_target;
use stackscope_symbolize::node::perf_map::{PerfMapReader, PerfMaps, REFRESH_INTERVAL, unnamed};

const COMM: [u8; 16] = *b"node\0\0\0\0\0\0\0\0\0\0\0\0";
/// Two processes: (tgid, pid in its own namespace).
const PROCESSES: [(u32, u32); 2] = [(100, 7), (200, 200)];

/// A fake proc root: `<tgid>/status` with the namespace pid, `<tgid>/maps`
/// naming a jitdump file, and `<tgid>/root/tmp/` holding both files.
fn proc_root() -> &'static Path {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    ROOT.get_or_init(|| {
        // tmpfs when there is one: a step costs a few file operations.
        let tmp = Path::new("/dev/shm");
        let tmp = if tmp.is_dir() {
            tmp.to_path_buf()
        } else {
            std::env::temp_dir()
        };
        let root = tmp.join(format!("stackscope-fuzz-perf-map-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for (tgid, pid) in PROCESSES {
            let process = root.join(tgid.to_string());
            std::fs::create_dir_all(process.join("root/tmp")).expect("fake proc root");
            std::fs::write(
                process.join("status"),
                format!("Name:\tnode\nNSpid:\t{tgid}\t{pid}\n"),
            )
            .expect("status");
            std::fs::write(
                process.join("maps"),
                format!("7f0000000000-7f0000001000 r-xp 00000000 00:00 1 /tmp/jit-{pid}.dump\n"),
            )
            .expect("maps");
        }
        root
    })
}

fn file(tgid: u32, pid: u32, dump: bool) -> PathBuf {
    let name = if dump {
        format!("jit-{pid}.dump")
    } else {
        format!("perf-{pid}.map")
    };
    proc_root().join(format!("{tgid}/root/tmp/{name}"))
}

/// The hex start of the last line of `text`, as a lookup address.
fn last_start(text: &[u8]) -> Option<u64> {
    let line = text.split(|&b| b == b'\n').rfind(|line| !line.is_empty())?;
    let field = line.split(|&b| b == b' ').next()?;
    let field = field.strip_prefix(b"0x").unwrap_or(field);
    u64::from_str_radix(std::str::from_utf8(field).ok()?, 16).ok()
}

fuzz_target!(|data: &[u8]| {
    let root = proc_root();
    for (tgid, pid) in PROCESSES {
        for dump in [false, true] {
            let _ = std::fs::remove_file(file(tgid, pid, dump));
        }
    }
    // Small bounds, so inputs reach both: the whole budget and one
    // process's share of it.
    let mut maps = PerfMaps::with_budget(4096, 2048);
    let mut reader = PerfMapReader::new(root);
    let start = Instant::now();
    let mut lookups = 0;
    for (step, bytes) in data.split(|&b| b == 0xff).enumerate() {
        let Some((&selector, text)) = bytes.split_first() else {
            continue;
        };
        let (tgid, pid) = PROCESSES[usize::from(selector & 1)];
        let path = file(tgid, pid, selector & 2 != 0);
        let mut options = std::fs::OpenOptions::new();
        options.create(true);
        if selector & 4 != 0 {
            options.write(true).truncate(true);
        } else {
            options.append(true);
        }
        options
            .open(&path)
            .and_then(|mut f| f.write_all(text))
            .expect("writing the fake file");
        let now = start + REFRESH_INTERVAL * (step as u32 + 1);
        let addresses = [last_start(text).unwrap_or(0), 0];
        for read in [false, true] {
            if read {
                let requests = maps.take_requests();
                maps.apply(reader.serve(requests, now));
            }
            for address in addresses {
                let name = maps
                    .name(tgid, 1, address, now)
                    .or_else(|| maps.name_later(tgid, 1, address, 1))
                    .unwrap_or_else(|| unnamed(&COMM));
                assert!(!name.is_empty());
                lookups += 1;
            }
        }
        assert!(maps.tracked() <= PROCESSES.len());
        assert!(reader.tracked() <= PROCESSES.len());
    }
    let stats = maps.stats();
    assert_eq!(stats.named + stats.unnamed, lookups);
});
