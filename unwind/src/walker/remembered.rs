//! The programs whose threads needed deep copies, kept on disk beside the
//! unwind tables so that the next agent (an upgrade, a node's reboot) knows
//! them from its first sample instead of learning them again.
//!
//! One small file per program, named by its executable's build-id and its
//! thread name (`<build-id>-<comm as hex>.deep`): a new build of the program
//! is a new file, and the old one ages out. Each file says what it is
//! (`FORMAT`), its thread name, its build-id and a checksum of those lines;
//! one that does not read back whole (a partial write, a format of another
//! version, a flipped byte) is refused and removed, and the others are
//! used. At most [`MAX_REMEMBERED`] files: the least recently written go.
//!
//! Owns the files only: what a deep program means (its threads planned
//! deep copies at their first learning, and woken early) is the planner's.

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    time::SystemTime,
};

use agent_common::COMM_LEN;
use stackscope_process_table::BuildId;

/// The first line of every file: what it is, and its format's version.
const FORMAT: &str = "stackscope deep program v1";
/// The files' extension.
const EXTENSION: &str = "deep";
/// Programs remembered at most (the sampler's map holds as many).
pub(super) const MAX_REMEMBERED: usize = agent_common::MAX_DEEP_PROGRAMS as usize;

/// What a directory's files gave back.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Loaded {
    /// Thread names of the deep programs, most recently written first.
    pub comms: Vec<[u8; COMM_LEN]>,
    /// Files refused (and removed): not whole, or of another format.
    pub refused: usize,
}

/// Reads the deep programs remembered in `dir` (none when it does not
/// exist), the most recently written first, at most [`MAX_REMEMBERED`].
pub(super) fn load(dir: &Path) -> Loaded {
    let mut loaded = Loaded::default();
    let mut files = remembered_files(dir);
    files.sort_by_key(|(written, _)| std::cmp::Reverse(*written));
    for (_, path) in files {
        let parsed = std::fs::read_to_string(&path)
            .ok()
            .and_then(|text| parse(&text));
        match parsed {
            Some(comm) if loaded.comms.len() < MAX_REMEMBERED => {
                if !loaded.comms.contains(&comm) {
                    loaded.comms.push(comm);
                }
            }
            Some(_) => {}
            None => {
                tracing::warn!("refusing {}: not a whole {FORMAT:?} file", path.display());
                let _ = std::fs::remove_file(&path);
                loaded.refused += 1;
            }
        }
    }
    loaded
}

/// Remembers in `dir` that the program `comm` (its executable's
/// `build_id`, when known) needs deep copies, then removes the least
/// recently written files beyond [`MAX_REMEMBERED`]. Failures only cost
/// the next agent a learning.
pub(super) fn save(dir: &Path, comm: &[u8; COMM_LEN], build_id: Option<&BuildId>) {
    let build_id = build_id.map_or_else(|| "-".to_string(), |id| id.to_string());
    let path = dir.join(format!("{build_id}-{}.{EXTENSION}", hex(comm)));
    let body = body(comm, &build_id);
    let text = format!("{body}checksum {:016x}\n", checksum(&body));
    let temporary = path.with_extension(format!("{EXTENSION}.tmp.{}", std::process::id()));
    let written = std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::write(&temporary, text))
        .and_then(|()| std::fs::rename(&temporary, &path));
    if let Err(err) = written {
        tracing::debug!("not remembering {}: {err}", path.display());
        let _ = std::fs::remove_file(&temporary);
        return;
    }
    let mut files = remembered_files(dir);
    if files.len() > MAX_REMEMBERED {
        files.sort();
        for (_, path) in &files[..files.len() - MAX_REMEMBERED] {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// The `.deep` files of `dir`, each with when it was last written.
fn remembered_files(dir: &Path) -> Vec<(SystemTime, PathBuf)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| path.extension().is_some_and(|ext| ext == EXTENSION))
        .filter_map(|path| Some((path.metadata().ok()?.modified().ok()?, path)))
        .collect()
}

/// The lines a file's checksum covers.
fn body(comm: &[u8; COMM_LEN], build_id: &str) -> String {
    format!("{FORMAT}\ncomm {}\nbuild_id {build_id}\n", hex(comm))
}

/// The thread name a file holds, if it is whole and of this format.
fn parse(text: &str) -> Option<[u8; COMM_LEN]> {
    let (body, checksum_line) = text.rsplit_once("checksum ")?;
    let written = u64::from_str_radix(checksum_line.strip_suffix('\n')?, 16).ok()?;
    if written != checksum(body) {
        return None;
    }
    let mut lines = body.lines();
    let comm_hex = lines.nth(1)?.strip_prefix("comm ")?;
    let build_id = lines.next()?.strip_prefix("build_id ")?;
    if comm_hex.len() != 2 * COMM_LEN {
        return None;
    }
    let mut comm = [0; COMM_LEN];
    for (byte, pair) in comm.iter_mut().zip(comm_hex.as_bytes().chunks(2)) {
        *byte = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
    }
    // This format and version exactly, nothing more; a name the kernel
    // could have given (not empty, NUL-terminated).
    (body == self::body(&comm, build_id) && comm[0] != 0 && comm[COMM_LEN - 1] == 0).then_some(comm)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::new(), |mut out, byte| {
        let _ = write!(out, "{byte:02x}");
        out
    })
}

/// FNV-1a, 64 bits: enough to tell a whole file from a damaged one.
fn checksum(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn comm(name: &str) -> [u8; COMM_LEN] {
        let mut comm = [0; COMM_LEN];
        comm[..name.len()].copy_from_slice(name.as_bytes());
        comm
    }

    fn build_id() -> BuildId {
        BuildId::new(&[0xab; 20]).expect("a build-id")
    }

    #[test]
    fn remembered_programs_come_back_newest_first() {
        let dir = tempfile::tempdir().expect("a directory");
        save(dir.path(), &comm("rustc"), Some(&build_id()));
        // Written later: first back.
        std::thread::sleep(std::time::Duration::from_millis(20));
        save(dir.path(), &comm("cc1plus"), None);
        let loaded = load(dir.path());
        assert_eq!(loaded.comms, [comm("cc1plus"), comm("rustc")]);
        assert_eq!(loaded.refused, 0);
        let names: Vec<String> = remembered_files(dir.path())
            .iter()
            .map(|(_, path)| path.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert!(
            names.contains(&format!("{}-{}.deep", build_id(), hex(&comm("rustc")))),
            "{names:?}"
        );
        // A missing directory is an empty memory.
        assert_eq!(load(&dir.path().join("none")), Loaded::default());
    }

    #[test]
    fn a_damaged_or_foreign_file_is_refused_and_removed_and_the_others_used() {
        let dir = tempfile::tempdir().expect("a directory");
        save(dir.path(), &comm("rustc"), Some(&build_id()));
        let good = remembered_files(dir.path()).remove(0).1;
        let text = std::fs::read_to_string(&good).expect("the file");
        let mut damaged = Vec::new();
        let mut write = |name: &str, contents: String| {
            let path = dir.path().join(name);
            std::fs::write(&path, contents).expect("writing");
            damaged.push(path);
        };
        // A flipped character, a truncated write, another version, a name
        // the kernel never gives, an extra line under a right checksum.
        write("a.deep", text.replacen("72757374", "72757375", 1));
        write("b.deep", text[..text.len() / 2].to_string());
        let v2 = body(&comm("gcc"), "-").replace(" v1", " v2");
        write("c.deep", format!("{v2}checksum {:016x}\n", checksum(&v2)));
        let unnamed = body(&[0; COMM_LEN], "-");
        write(
            "d.deep",
            format!("{unnamed}checksum {:016x}\n", checksum(&unnamed)),
        );
        let extra = format!("{}more\n", body(&comm("gcc"), "-"));
        write(
            "e.deep",
            format!("{extra}checksum {:016x}\n", checksum(&extra)),
        );
        let loaded = load(dir.path());
        assert_eq!(loaded.comms, [comm("rustc")]);
        assert_eq!(loaded.refused, 5);
        for path in damaged {
            assert!(!path.exists(), "{} kept", path.display());
        }
        assert!(good.exists());
    }

    #[test]
    fn the_least_recently_written_go_beyond_the_bound() {
        let dir = tempfile::tempdir().expect("a directory");
        for n in 0..MAX_REMEMBERED + 3 {
            save(dir.path(), &comm(&format!("p{n}")), None);
            // Distinct modification times, oldest first.
            let (_, path) = remembered_files(dir.path())
                .into_iter()
                .find(|(_, path)| {
                    path.to_string_lossy()
                        .contains(&hex(&comm(&format!("p{n}"))))
                })
                .expect("just written");
            let file = std::fs::File::options().write(true).open(&path).unwrap();
            file.set_modified(
                SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(n as u64 + 1),
            )
            .unwrap();
        }
        save(dir.path(), &comm("last"), None);
        let loaded = load(dir.path());
        assert_eq!(loaded.comms.len(), MAX_REMEMBERED);
        assert_eq!(loaded.comms[0], comm("last"));
        for gone in ["p0", "p1", "p2", "p3"] {
            assert!(!loaded.comms.contains(&comm(gone)), "{gone} kept");
        }
        assert!(loaded.comms.contains(&comm("p4")));
    }
}
