//! Finds the separate debug file of a stripped binary on the node: by
//! build-id under `usr/lib/debug/.build-id/` (Debian's `-dbg` and `-dbgsym`
//! packages), then through its `.gnu_debuglink` (next to the binary, in its
//! `.debug/` directory, and under `usr/lib/debug/`), each first under the
//! host's root and then under the root of the process that maps it (a
//! container's own packages). A file found by build-id must carry that
//! build-id, one found by debug link the CRC the link records: a debug file
//! of another build never names a frame.
//!
//! A binary that names itself (`.symtab` or DWARF) needs none, and one with
//! MiniDebugInfo (`.gnu_debugdata`) is read by blazesym itself.

use std::{
    fs::File,
    io::Read as _,
    path::{Path, PathBuf},
};

use object::{Object as _, ObjectSection as _};
use stackscope_collector_client::{carries_symbols, holds_section};

/// What a binary says about where its names are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NameSource {
    /// Its own `.symtab` or DWARF: what a collector can name frames with
    /// too.
    Symbols,
    /// MiniDebugInfo (`.gnu_debugdata`): its function symbols, compressed,
    /// which blazesym reads on the node.
    MiniDebugInfo,
    /// Only its dynamic symbols: a debug file elsewhere may hold the rest.
    Elsewhere {
        /// `.gnu_debuglink`: the debug file's name and the CRC-32 of its
        /// contents.
        debug_link: Option<(String, u32)>,
    },
}

/// Reads `file`'s sections to tell where its names are; `None` when it is
/// not readable as ELF.
pub fn name_source(file: &File) -> Option<NameSource> {
    let cache = object::ReadCache::new(file);
    let elf = object::File::parse(&cache).ok()?;
    if carries_symbols(&elf) {
        return Some(NameSource::Symbols);
    }
    if holds_section(&elf, ".gnu_debugdata") {
        return Some(NameSource::MiniDebugInfo);
    }
    let debug_link = elf
        .section_by_name(".gnu_debuglink")
        .and_then(|section| section.data().ok())
        .and_then(parse_debug_link);
    Some(NameSource::Elsewhere { debug_link })
}

/// `.gnu_debuglink`: a NUL-terminated file name, padding to 4 bytes, and
/// the CRC-32 of the debug file (in the file's byte order; little-endian on
/// x86_64).
fn parse_debug_link(data: &[u8]) -> Option<(String, u32)> {
    let end = data.iter().position(|&b| b == 0)?;
    let name = std::str::from_utf8(&data[..end]).ok()?;
    // A bare file name: a link must not reach outside the directories
    // searched.
    if name.is_empty() || name.contains('/') || name == ".." {
        return None;
    }
    let crc_at = (end + 1).next_multiple_of(4);
    let crc = data.get(crc_at..crc_at + 4)?;
    Some((name.to_owned(), u32::from_le_bytes(crc.try_into().ok()?)))
}

/// The debug file of a binary with build-id `build_id` (lower-case hex),
/// mapped from `path` (as the process sees it), under each of `roots` in
/// order.
pub fn find_debug_file(
    roots: &[PathBuf],
    build_id: Option<&str>,
    path: Option<&Path>,
    source: &NameSource,
) -> Option<File> {
    let NameSource::Elsewhere { debug_link } = source else {
        return None;
    };
    for root in roots {
        if let Some(build_id) = build_id.filter(|id| id.len() > 2) {
            let candidate = root.join(format!(
                "usr/lib/debug/.build-id/{}/{}.debug",
                &build_id[..2],
                &build_id[2..]
            ));
            if let Some(file) = open_with_build_id(&candidate, build_id) {
                return Some(file);
            }
        }
        if let (Some((name, crc)), Some(dir)) = (debug_link, path.and_then(Path::parent)) {
            // The binary's directory, inside `root`.
            let dir = dir.strip_prefix("/").unwrap_or(dir);
            let candidates = [
                root.join(dir).join(name),
                root.join(dir).join(".debug").join(name),
                root.join("usr/lib/debug").join(dir).join(name),
            ];
            for candidate in candidates {
                if let Some(file) = open_with_crc(&candidate, *crc) {
                    return Some(file);
                }
            }
        }
    }
    None
}

/// Largest debug file read (libLLVM's is about 1.5 GB).
const MAX_DEBUG_FILE_BYTES: u64 = 4 << 30;

/// Opens `path` only if it is a regular file of a sane size. The paths
/// under a container's root are the container's to choose: a FIFO there
/// would block a plain open forever, and a symlink to `/dev/zero` would be
/// read forever. Opening without blocking and checking what was opened
/// rules both out.
fn open_regular(path: &Path) -> Option<File> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let file = File::options()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .ok()?;
    let metadata = file.metadata().ok()?;
    (metadata.is_file() && metadata.len() <= MAX_DEBUG_FILE_BYTES).then_some(file)
}

fn open_with_build_id(path: &Path, build_id: &str) -> Option<File> {
    let file = open_regular(path)?;
    let found = {
        let cache = object::ReadCache::new(&file);
        let elf = object::File::parse(&cache).ok()?;
        super::hex(elf.build_id().ok()??)
    };
    (found == build_id).then_some(file)
}

fn open_with_crc(path: &Path, expected: u32) -> Option<File> {
    let mut file = open_regular(path)?;
    let mut hasher = crc32fast::Hasher::new();
    let mut buffer = vec![0u8; 1 << 16];
    loop {
        let read = file.read(&mut buffer).ok()?;
        if read == 0 {
            break;
        }
        hasher.update(&buffer[..read]);
    }
    (hasher.finalize() == expected).then_some(file)
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use stackscope_test_fixtures::split_debug::{SplitDebug, run_tool};

    use super::*;

    #[test]
    fn only_regular_files_are_opened() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo.debug");
        let c_path = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
        // Would block forever with a plain open (no writer).
        assert!(open_regular(&fifo).is_none());
        let zero = dir.path().join("zero.debug");
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        assert!(open_with_crc(&zero, 0).is_none());
        let plain = dir.path().join("plain.debug");
        std::fs::write(&plain, b"x").unwrap();
        assert!(open_regular(&plain).is_some());
    }

    #[test]
    fn debug_links_are_parsed_as_bare_names_with_their_crc() {
        let mut link = b"prog.debug\0\0".to_vec();
        link.extend_from_slice(&0x1234_5678u32.to_le_bytes());
        assert_eq!(
            parse_debug_link(&link),
            Some(("prog.debug".into(), 0x1234_5678))
        );
        assert_eq!(parse_debug_link(&link[..13]), None, "truncated CRC");
        assert_eq!(parse_debug_link(b"prog.debug"), None, "no NUL");
        let mut outside = b"../../x\0".to_vec();
        outside.extend_from_slice(&[0; 4]);
        assert_eq!(parse_debug_link(&outside), None);
    }

    /// A stripped binary finds its debug file by build-id and by debug
    /// link under a root, and not a debug file of another build.
    #[test]
    fn debug_files_are_found_by_build_id_and_by_link_and_checked() {
        let built = SplitDebug::from_source("prog", "int main(void) { return 0; }\n", &[]);
        let (full, debug, build_id) = (&built.full, &built.debug, built.build_id.as_str());
        let root = built.dir().join("root");
        let bin_dir = root.join("opt/app");
        std::fs::create_dir_all(&bin_dir).expect("dirs");
        let binary = bin_dir.join("prog");
        run_tool(
            Command::new("objcopy")
                .arg("--strip-all")
                .arg(format!("--add-gnu-debuglink={}", debug.display()))
                .arg(full)
                .arg(&binary),
        );

        let full_source = name_source(&File::open(full).expect("open")).expect("ELF");
        assert_eq!(full_source, NameSource::Symbols);
        let source = name_source(&File::open(&binary).expect("open")).expect("ELF");
        let NameSource::Elsewhere {
            debug_link: Some((name, _)),
        } = &source
        else {
            panic!("{source:?}");
        };
        assert_eq!(name, "prog.debug");
        let roots = [root.clone()];
        let mapped = Path::new("/opt/app/prog");
        assert!(find_debug_file(&roots, Some(build_id), Some(mapped), &source).is_none());

        // By debug link, in the binary's .debug directory.
        std::fs::create_dir(bin_dir.join(".debug")).expect("dir");
        std::fs::copy(debug, bin_dir.join(".debug/prog.debug")).expect("copy");
        assert!(find_debug_file(&roots, Some(build_id), Some(mapped), &source).is_some());
        // A file of another content under the link's name is refused.
        std::fs::write(bin_dir.join(".debug/prog.debug"), b"another build").expect("write");
        assert!(find_debug_file(&roots, Some(build_id), Some(mapped), &source).is_none());

        // By build-id; a file there with another build-id is refused.
        let by_id = root.join(format!("usr/lib/debug/.build-id/{}", &build_id[..2]));
        std::fs::create_dir_all(&by_id).expect("dirs");
        let target = by_id.join(format!("{}.debug", &build_id[2..]));
        std::fs::copy(debug, &target).expect("copy");
        assert!(find_debug_file(&roots, Some(build_id), None, &source).is_some());
        let other = format!("{}{}", &build_id[..2], "0".repeat(build_id.len() - 2));
        std::fs::copy(debug, by_id.join(format!("{}.debug", &other[2..]))).expect("copy");
        assert!(find_debug_file(&roots, Some(&other), None, &source).is_none());
    }
}
