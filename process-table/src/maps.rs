//! Parsing `/proc/<pid>/maps`.
//!
//! Owns: turning the text the kernel prints for each VMA into [`Mapping`]
//! values, classifying the name column ([`MappingPath`]), and reading a whole
//! maps file while telling "the process is gone" apart from real I/O errors.
//!
//! Does not own: deciding which mappings matter (the [`table`](crate::table)
//! keeps the executable ones), opening the files behind mappings
//! ([`open`](crate::open)) or identifying them ([`object_id`](crate::object_id)).
//!
//! The parser works on bytes, not `str`: file names on Linux are arbitrary
//! bytes and a non-UTF-8 library path must not make a whole process
//! unreadable. The kernel prints a name with its newlines escaped as `\012`
//! but nothing else escaped (a literal `\012` in a name is indistinguishable),
//! so names are kept exactly as printed; callers that need the file itself go
//! through `/proc/<pid>/map_files`, which does not depend on the name.

use std::{
    ffi::OsStr,
    fmt, io,
    os::unix::ffi::OsStrExt as _,
    path::{Path, PathBuf},
};

use thiserror::Error;

/// The suffix the kernel appends to the name of a file that was unlinked
/// while still mapped.
const DELETED_SUFFIX: &[u8] = b" (deleted)";

/// The prefix of the name of a `memfd_create(2)` file (shown as a path on the
/// internal shmem mount).
const MEMFD_PREFIX: &[u8] = b"/memfd:";

/// One line of `/proc/<pid>/maps`: a virtual memory area.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    /// First address of the area.
    pub start: u64,
    /// One past the last address of the area.
    pub end: u64,
    pub perms: Perms,
    /// Offset in the file (in bytes) that `start` maps; 0 for anonymous memory.
    pub offset: u64,
    /// Device of the file's filesystem, as printed (`major:minor`).
    pub dev: Dev,
    /// Inode of the file; 0 for anonymous memory.
    pub inode: u64,
    pub path: MappingPath,
}

impl Mapping {
    /// Whether `addr` lies in `[start, end)`.
    pub fn contains(&self, addr: u64) -> bool {
        (self.start..self.end).contains(&addr)
    }

    /// Size of the area in bytes.
    pub fn len(&self) -> u64 {
        self.end.saturating_sub(self.start)
    }

    /// Whether the area is empty (the kernel never prints one, but the type
    /// allows it).
    pub fn is_empty(&self) -> bool {
        self.end <= self.start
    }

    /// Whether a file (regular, deleted, memfd, SysV shm...) backs the area:
    /// the kernel prints inode 0 for anonymous memory and the special areas.
    pub fn is_file_backed(&self) -> bool {
        self.inode != 0
    }
}

/// The `rwxp` column.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Perms {
    pub read: bool,
    pub write: bool,
    pub exec: bool,
    /// `p` (copy-on-write private mapping) rather than `s` (shared).
    pub private: bool,
}

impl fmt::Display for Perms {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let flag = |set: bool, c: char| if set { c } else { '-' };
        write!(
            f,
            "{}{}{}{}",
            flag(self.read, 'r'),
            flag(self.write, 'w'),
            flag(self.exec, 'x'),
            if self.private { 'p' } else { 's' }
        )
    }
}

/// A device number as `/proc/<pid>/maps` prints it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Dev {
    pub major: u32,
    pub minor: u32,
}

impl Dev {
    /// Splits a `st_dev` value the way glibc's `major(3)`/`minor(3)` do, so a
    /// file's metadata can be compared with a maps line.
    pub fn from_st_dev(st_dev: u64) -> Self {
        Self {
            major: libc::major(st_dev),
            minor: libc::minor(st_dev),
        }
    }
}

impl fmt::Display for Dev {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:02x}:{:02x}", self.major, self.minor)
    }
}

/// What the name column of a maps line says is behind the area.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum MappingPath {
    /// A file on some filesystem. `deleted` when the kernel appended
    /// ` (deleted)`: the name no longer leads to this file (unlinked, or
    /// replaced by a new version), only `/proc/<pid>/map_files` does.
    File { path: PathBuf, deleted: bool },
    /// A `memfd_create(2)` file; `name` is what the program passed, without
    /// the `/memfd:` prefix. Memfds are always shown as deleted.
    Memfd { name: Vec<u8>, deleted: bool },
    /// `[stack]`: the main thread's stack.
    Stack,
    /// `[heap]`: the `brk` area.
    Heap,
    /// `[vdso]`: code the kernel maps into every process; there is no file,
    /// the agent unwinds it with its own copy of the image.
    Vdso,
    /// `[vvar]`: data pages read by the vDSO.
    Vvar,
    /// `[vsyscall]`: the legacy fixed-address syscall page.
    Vsyscall,
    /// No name: anonymous memory (JIT code, thread stacks, `malloc` arenas).
    Anonymous,
    /// Any other name, kept verbatim: `[anon:name]` (prctl-named memory),
    /// `[vvar_vclock]`, `anon_inode:[perf_event]`, and names future kernels
    /// invent.
    Other(Vec<u8>),
}

impl MappingPath {
    /// Whether executable memory of this name is JIT code: anonymous
    /// memory, or named anonymous memory (`[anon:name]`, from `prctl`).
    /// Not the vDSO (its image is known) nor `[vsyscall]`.
    pub fn is_jit_code(&self) -> bool {
        match self {
            MappingPath::Anonymous => true,
            MappingPath::Other(name) => name.starts_with(b"[anon:"),
            _ => false,
        }
    }

    /// Classifies the name column (already stripped of the padding before it).
    pub fn parse(name: &[u8]) -> Self {
        match name {
            b"" => Self::Anonymous,
            b"[stack]" => Self::Stack,
            b"[heap]" => Self::Heap,
            b"[vdso]" => Self::Vdso,
            b"[vvar]" => Self::Vvar,
            b"[vsyscall]" => Self::Vsyscall,
            _ => {
                let (name, deleted) = match name.strip_suffix(DELETED_SUFFIX) {
                    Some(stripped) => (stripped, true),
                    None => (name, false),
                };
                if let Some(memfd) = name.strip_prefix(MEMFD_PREFIX) {
                    Self::Memfd {
                        name: memfd.to_vec(),
                        deleted,
                    }
                } else if name.first() == Some(&b'/') {
                    Self::File {
                        path: PathBuf::from(OsStr::from_bytes(name)),
                        deleted,
                    }
                } else {
                    // Not a path: keep the suffix too, it is part of the name.
                    let original = if deleted {
                        [name, DELETED_SUFFIX].concat()
                    } else {
                        name.to_vec()
                    };
                    Self::Other(original)
                }
            }
        }
    }

    /// The file path, for regular files.
    pub fn file_path(&self) -> Option<&Path> {
        match self {
            Self::File { path, .. } => Some(path),
            _ => None,
        }
    }

    /// The name a profile carries for the area: a file's path as the
    /// process sees it without the ` (deleted)` mark (its identity says
    /// which version), `/memfd:<name>` for a memfd, else the name as maps
    /// shows it.
    pub fn shipped_name(&self) -> String {
        match self {
            Self::File { path, .. } => path.to_string_lossy().into_owned(),
            Self::Memfd { name, .. } => format!("/memfd:{}", String::from_utf8_lossy(name)),
            other => other.to_string(),
        }
    }

    /// Whether the file behind the area was unlinked or replaced.
    pub fn is_deleted(&self) -> bool {
        matches!(
            self,
            Self::File { deleted: true, .. } | Self::Memfd { deleted: true, .. }
        )
    }
}

impl fmt::Display for MappingPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let deleted = |deleted: bool| if deleted { " (deleted)" } else { "" };
        match self {
            Self::File { path, deleted: d } => write!(f, "{}{}", path.display(), deleted(*d)),
            Self::Memfd { name, deleted: d } => {
                write!(f, "/memfd:{}{}", String::from_utf8_lossy(name), deleted(*d))
            }
            Self::Stack => f.write_str("[stack]"),
            Self::Heap => f.write_str("[heap]"),
            Self::Vdso => f.write_str("[vdso]"),
            Self::Vvar => f.write_str("[vvar]"),
            Self::Vsyscall => f.write_str("[vsyscall]"),
            Self::Anonymous => Ok(()),
            Self::Other(name) => f.write_str(&String::from_utf8_lossy(name)),
        }
    }
}

/// The fields of a maps line, in order, for error messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    Start,
    End,
    Perms,
    Offset,
    Device,
    Inode,
}

impl fmt::Display for Field {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Start => "start address",
            Self::End => "end address",
            Self::Perms => "permissions",
            Self::Offset => "offset",
            Self::Device => "device",
            Self::Inode => "inode",
        })
    }
}

/// What is wrong with a maps line.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LineErrorKind {
    /// The line ends before this field.
    #[error("missing {0}")]
    Missing(Field),
    /// The field is not a number in the base the kernel prints it in (hex for
    /// everything but the inode), or does not fit in 64 bits.
    #[error("{field} {text:?} is not a valid number")]
    BadNumber { field: Field, text: String },
    /// The permissions are not four characters of the form `[r-][w-][x-][ps]`.
    #[error("permissions {0:?} are not of the form rwxp")]
    BadPerms(String),
    /// The end address is below the start address.
    #[error("end {end:#x} is below start {start:#x}")]
    InvertedRange { start: u64, end: u64 },
}

/// A maps line that could not be parsed, with the line itself so the log
/// shows what the kernel (or a test) actually printed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("maps line {number} {line:?}: {kind}")]
pub struct LineError {
    /// 1-based line number within the file (1 for [`parse_line`]).
    pub number: usize,
    /// The line, lossily converted to UTF-8.
    pub line: String,
    #[source]
    pub kind: LineErrorKind,
}

/// Why `/proc/<pid>/maps` could not be read.
#[derive(Debug, Error)]
pub enum MapsError {
    /// The process does not exist (any more), or has exited and is a zombie
    /// waiting to be reaped (its maps are then empty).
    #[error("process {pid} is gone")]
    ProcessGone { pid: u32 },
    /// Opening or reading failed for another reason (e.g. permissions).
    #[error("reading /proc/{pid}/maps")]
    Io {
        pid: u32,
        #[source]
        source: io::Error,
    },
    /// The kernel printed something this parser does not understand.
    #[error("parsing /proc/{pid}/maps")]
    Parse {
        pid: u32,
        #[source]
        source: LineError,
    },
}

/// Reads and parses `/proc/<pid>/maps`.
///
/// A process that exits while we read shows up as `ENOENT`/`ESRCH` or as an
/// empty file; both become [`MapsError::ProcessGone`]. Kernel threads also
/// have empty maps, and are equally useless to a user-space unwinder.
pub fn read_maps(pid: u32) -> Result<Vec<Mapping>, MapsError> {
    read_maps_at(Path::new("/proc"), pid)
}

/// [`read_maps`] under another procfs mount (e.g. a host `/proc` bind-mounted
/// into the agent's container).
pub fn read_maps_at(proc_root: &Path, pid: u32) -> Result<Vec<Mapping>, MapsError> {
    let path = proc_root.join(pid.to_string()).join("maps");
    let bytes = std::fs::read(&path).map_err(|source| {
        if is_gone(&source) {
            MapsError::ProcessGone { pid }
        } else {
            MapsError::Io { pid, source }
        }
    })?;
    let mappings = parse_maps(&bytes).map_err(|source| MapsError::Parse { pid, source })?;
    if mappings.is_empty() {
        return Err(MapsError::ProcessGone { pid });
    }
    Ok(mappings)
}

/// Whether an error from a `/proc/<pid>/...` access means the process is gone.
pub(crate) fn is_gone(err: &io::Error) -> bool {
    matches!(err.raw_os_error(), Some(libc::ENOENT | libc::ESRCH))
}

/// Parses a whole maps file. Empty lines (only the trailing newline produces
/// one in practice) are skipped.
pub fn parse_maps(text: &[u8]) -> Result<Vec<Mapping>, LineError> {
    text.split(|&b| b == b'\n')
        .enumerate()
        .filter(|(_, line)| !line.is_empty())
        .map(|(index, line)| parse_numbered(line, index + 1))
        .collect()
}

/// Parses one maps line (without its newline).
pub fn parse_line(line: &[u8]) -> Result<Mapping, LineError> {
    parse_numbered(line, 1)
}

fn parse_numbered(line: &[u8], number: usize) -> Result<Mapping, LineError> {
    parse_fields(line).map_err(|kind| LineError {
        number,
        line: String::from_utf8_lossy(line).into_owned(),
        kind,
    })
}

/// `start-end perms offset major:minor inode<padding>name`: the kernel's
/// `show_vma_header_prefix` followed by the padded name.
fn parse_fields(line: &[u8]) -> Result<Mapping, LineErrorKind> {
    let mut rest = line;
    let start = hex(take_until(&mut rest, b'-', Field::Start)?, Field::Start)?;
    let end = hex(take_until(&mut rest, b' ', Field::End)?, Field::End)?;
    let perms = parse_perms(take_until(&mut rest, b' ', Field::Perms)?)?;
    let offset = hex(take_until(&mut rest, b' ', Field::Offset)?, Field::Offset)?;
    let dev = parse_dev(take_until(&mut rest, b' ', Field::Device)?)?;
    // The kernel prints a space after the inode even when no name follows,
    // but accept a line whose inode is last (hand-edited, or trimmed).
    let inode_text = match rest.iter().position(|&b| b == b' ') {
        Some(space) => {
            let (inode, after) = rest.split_at(space);
            rest = &after[1..];
            inode
        }
        None => std::mem::take(&mut rest),
    };
    if inode_text.is_empty() {
        return Err(LineErrorKind::Missing(Field::Inode));
    }
    let inode = decimal(inode_text, Field::Inode)?;
    if end < start {
        return Err(LineErrorKind::InvertedRange { start, end });
    }
    // Only the padding is stripped: a name never starts with a space (paths
    // are absolute, special names start with '[' or a word), but may end
    // with one.
    let name_start = rest.iter().position(|&b| b != b' ').unwrap_or(rest.len());
    let path = MappingPath::parse(&rest[name_start..]);
    Ok(Mapping {
        start,
        end,
        perms,
        offset,
        dev,
        inode,
        path,
    })
}

/// Splits `rest` at the first `delimiter`, returning the part before it and
/// leaving the part after it in `rest`.
fn take_until<'a>(
    rest: &mut &'a [u8],
    delimiter: u8,
    field: Field,
) -> Result<&'a [u8], LineErrorKind> {
    let at = rest
        .iter()
        .position(|&b| b == delimiter)
        .ok_or(LineErrorKind::Missing(field))?;
    let (value, after) = rest.split_at(at);
    if value.is_empty() {
        return Err(LineErrorKind::Missing(field));
    }
    *rest = &after[1..];
    Ok(value)
}

fn hex(text: &[u8], field: Field) -> Result<u64, LineErrorKind> {
    number(text, 16, field)
}

fn decimal(text: &[u8], field: Field) -> Result<u64, LineErrorKind> {
    number(text, 10, field)
}

fn number(text: &[u8], radix: u32, field: Field) -> Result<u64, LineErrorKind> {
    let bad = || LineErrorKind::BadNumber {
        field,
        text: String::from_utf8_lossy(text).into_owned(),
    };
    // from_str_radix accepts a leading '+', the kernel never prints one.
    if text.first() == Some(&b'+') {
        return Err(bad());
    }
    let text_str = std::str::from_utf8(text).map_err(|_| bad())?;
    u64::from_str_radix(text_str, radix).map_err(|_| bad())
}

/// `major:minor`, both hex.
fn parse_dev(text: &[u8]) -> Result<Dev, LineErrorKind> {
    let bad = || LineErrorKind::BadNumber {
        field: Field::Device,
        text: String::from_utf8_lossy(text).into_owned(),
    };
    let colon = text.iter().position(|&b| b == b':').ok_or_else(bad)?;
    let (major, minor) = (&text[..colon], &text[colon + 1..]);
    // Device numbers are 12 and 20 bits: anything wider than 32 is garbage.
    let part = |part: &[u8]| {
        hex(part, Field::Device)
            .ok()
            .and_then(|value| u32::try_from(value).ok())
            .ok_or_else(bad)
    };
    Ok(Dev {
        major: part(major)?,
        minor: part(minor)?,
    })
}

fn parse_perms(text: &[u8]) -> Result<Perms, LineErrorKind> {
    let bad = || LineErrorKind::BadPerms(String::from_utf8_lossy(text).into_owned());
    let &[r, w, x, p] = text else {
        return Err(bad());
    };
    let flag = |c: u8, set: u8| match c {
        b'-' => Ok(false),
        c if c == set => Ok(true),
        _ => Err(bad()),
    };
    Ok(Perms {
        read: flag(r, b'r')?,
        write: flag(w, b'w')?,
        exec: flag(x, b'x')?,
        private: match p {
            b'p' => true,
            b's' => false,
            _ => return Err(bad()),
        },
    })
}

/// This process's own vDSO: where it is mapped and its image, which is the
/// same in every process on this kernel (the walker compiles its table, the
/// symbolizer names its frames). The image is borrowed for the process's
/// lifetime: a caller must not unmap (or `mremap`) its own vDSO afterwards,
/// which the agent never does and programs do not do.
pub fn own_vdso_image() -> Option<(u64, &'static [u8])> {
    let maps = read_maps(std::process::id()).ok()?;
    let vdso = maps.iter().find(|m| m.path == MappingPath::Vdso)?;
    let len = usize::try_from(vdso.end.checked_sub(vdso.start)?).ok()?;
    // SAFETY: the kernel maps the vDSO readable for the process's whole
    // lifetime unless the process unmaps it, which the agent never does;
    // `start..end` is that mapping in ours.
    let image = unsafe { std::slice::from_raw_parts(vdso.start as *const u8, len) };
    Some((vdso.start, image))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn perms(text: &str) -> Perms {
        parse_perms(text.as_bytes()).expect("valid perms in test")
    }

    fn parse(line: &str) -> Result<Mapping, LineError> {
        parse_line(line.as_bytes())
    }

    fn error_kind(line: &str) -> LineErrorKind {
        match parse(line) {
            Ok(mapping) => panic!("{line:?} parsed as {mapping:?}"),
            Err(err) => {
                assert_eq!(err.line, line, "the error names the line");
                err.kind
            }
        }
    }

    #[test]
    fn shipped_names_drop_the_deleted_mark() {
        for (name, shipped) in [
            (&b"/usr/bin/sort (deleted)"[..], "/usr/bin/sort"),
            (b"/memfd:doublemapper (deleted)", "/memfd:doublemapper"),
            (b"[vdso]", "[vdso]"),
            (b"[anon:v8 code]", "[anon:v8 code]"),
        ] {
            assert_eq!(MappingPath::parse(name).shipped_name(), shipped);
        }
    }

    #[test]
    fn regular_file() {
        let mapping = parse(
            "7f1c2a628000-7f1c2a7bd000 r-xp 00028000 fe:01 1837004                    /usr/lib/x86_64-linux-gnu/libc.so.6",
        )
        .expect("parses");
        assert_eq!(
            mapping,
            Mapping {
                start: 0x7f1c2a628000,
                end: 0x7f1c2a7bd000,
                perms: perms("r-xp"),
                offset: 0x28000,
                dev: Dev {
                    major: 0xfe,
                    minor: 0x01
                },
                inode: 1837004,
                path: MappingPath::File {
                    path: PathBuf::from("/usr/lib/x86_64-linux-gnu/libc.so.6"),
                    deleted: false
                },
            }
        );
        assert!(mapping.perms.exec && mapping.perms.read && !mapping.perms.write);
        assert!(mapping.perms.private);
        assert!(mapping.is_file_backed());
        assert_eq!(mapping.len(), 0x195000);
        assert!(mapping.contains(0x7f1c2a628000));
        assert!(!mapping.contains(0x7f1c2a7bd000));
    }

    #[test]
    fn path_with_spaces_and_trailing_space() {
        let mapping = parse("00400000-00401000 r-xp 00000000 08:02 42   /opt/my app/bin/a b ")
            .expect("parses");
        assert_eq!(
            mapping.path,
            MappingPath::File {
                path: PathBuf::from("/opt/my app/bin/a b "),
                deleted: false
            }
        );
    }

    #[test]
    fn deleted_file() {
        let mapping = parse(
            "55d0c8a00000-55d0c8a01000 r-xp 00001000 00:2a 77  /tmp/.tmpXyZ/target (deleted)",
        )
        .expect("parses");
        assert_eq!(
            mapping.path,
            MappingPath::File {
                path: PathBuf::from("/tmp/.tmpXyZ/target"),
                deleted: true
            }
        );
        assert!(mapping.path.is_deleted());
        assert_eq!(mapping.path.to_string(), "/tmp/.tmpXyZ/target (deleted)");
    }

    #[test]
    fn deleted_file_with_spaces() {
        let mapping =
            parse("1000-2000 r-xp 00000000 08:01 9 /a b/c (deleted) (deleted)").expect("parses");
        // Only the suffix the kernel adds is stripped.
        assert_eq!(
            mapping.path,
            MappingPath::File {
                path: PathBuf::from("/a b/c (deleted)"),
                deleted: true
            }
        );
    }

    #[test]
    fn memfd() {
        let mapping =
            parse("7f0000000000-7f0000001000 r-xs 00000000 00:01 1025 /memfd:jit code (deleted)")
                .expect("parses");
        assert_eq!(
            mapping.path,
            MappingPath::Memfd {
                name: b"jit code".to_vec(),
                deleted: true
            }
        );
        assert!(!mapping.perms.private);
        assert_eq!(mapping.perms.to_string(), "r-xs");
    }

    #[test]
    fn special_areas() {
        let cases = [
            (
                "7ffd5e1f3000-7ffd5e214000 rw-p 00000000 00:00 0                          [stack]",
                MappingPath::Stack,
            ),
            (
                "55d0c9b2e000-55d0c9b4f000 rw-p 00000000 00:00 0                          [heap]",
                MappingPath::Heap,
            ),
            (
                "7ffd5e3d6000-7ffd5e3d8000 r-xp 00000000 00:00 0                          [vdso]",
                MappingPath::Vdso,
            ),
            (
                "7ffd5e3d2000-7ffd5e3d6000 r--p 00000000 00:00 0                          [vvar]",
                MappingPath::Vvar,
            ),
            (
                "ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0                  [vsyscall]",
                MappingPath::Vsyscall,
            ),
            (
                "7f1c2a5fe000-7f1c2a601000 rw-p 00000000 00:00 0 ",
                MappingPath::Anonymous,
            ),
            (
                "7f1c2a5fe000-7f1c2a601000 rw-p 00000000 00:00 0",
                MappingPath::Anonymous,
            ),
            (
                "7f1c2a5fe000-7f1c2a601000 rw-p 00000000 00:00 0     [anon:glibc malloc]",
                MappingPath::Other(b"[anon:glibc malloc]".to_vec()),
            ),
        ];
        for (line, expected) in cases {
            let mapping = parse(line).unwrap_or_else(|err| panic!("{line:?}: {err}"));
            assert_eq!(mapping.path, expected, "{line:?}");
            assert_eq!(mapping.inode, 0, "{line:?}");
            assert!(!mapping.is_file_backed(), "{line:?}");
        }
    }

    #[test]
    fn anon_inode_is_other_but_has_an_inode() {
        let mapping =
            parse("7f1c2a5fe000-7f1c2a601000 rw-s 00000000 00:0e 1054  anon_inode:[perf_event]")
                .expect("parses");
        assert_eq!(
            mapping.path,
            MappingPath::Other(b"anon_inode:[perf_event]".to_vec())
        );
        assert_eq!(
            mapping.dev,
            Dev {
                major: 0,
                minor: 0xe
            }
        );
        assert!(mapping.is_file_backed());
    }

    #[test]
    fn vsyscall_perms_and_range() {
        let mapping = parse("ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0 [vsyscall]")
            .expect("parses");
        assert_eq!(mapping.start, 0xffffffffff600000);
        assert_eq!(mapping.end, 0xffffffffff601000);
        assert_eq!(
            mapping.perms,
            Perms {
                exec: true,
                private: true,
                ..Perms::default()
            }
        );
    }

    #[test]
    fn non_utf8_path() {
        let mut line = b"1000-2000 r-xp 00000000 08:01 9 /lib/\xffbad.so".to_vec();
        let mapping = parse_line(&line).expect("parses");
        assert_eq!(
            mapping.path.file_path().map(|p| p.as_os_str().as_bytes()),
            Some(&b"/lib/\xffbad.so"[..])
        );
        // A bad byte in a number is still an error, reported lossily.
        line[0] = 0xff;
        let err = parse_line(&line).expect_err("bad start");
        assert_eq!(
            err.kind,
            LineErrorKind::BadNumber {
                field: Field::Start,
                text: "\u{fffd}000".to_string()
            }
        );
    }

    #[test]
    fn garbage_lines() {
        let missing = LineErrorKind::Missing;
        let bad = |field, text: &str| LineErrorKind::BadNumber {
            field,
            text: text.to_string(),
        };
        let cases: Vec<(&str, LineErrorKind)> = vec![
            ("hello", missing(Field::Start)),
            ("-2000 r-xp 0 08:01 9", missing(Field::Start)),
            ("1000- r-xp 0 08:01 9", missing(Field::End)),
            ("1000-2000", missing(Field::End)),
            ("1000-2000 r-xp", missing(Field::Perms)),
            ("1000-2000 r-xp 00000000", missing(Field::Offset)),
            ("1000-2000 r-xp 00000000 08:01", missing(Field::Device)),
            (
                "1000-2000 r-xp 00000000 0801 9 /a:b",
                bad(Field::Device, "0801"),
            ),
            ("1000-2000 r-xp 00000000 :01 9", bad(Field::Device, ":01")),
            ("1000-2000 r-xp 00000000 08: 9", bad(Field::Device, "08:")),
            ("1000-2000 r-xp 00000000 08:01 ", missing(Field::Inode)),
            (
                "1000-2000 r-xp 00000000 08:01  /lib/a.so",
                missing(Field::Inode),
            ),
            ("10g0-2000 r-xp 0 08:01 9", bad(Field::Start, "10g0")),
            ("+1000-2000 r-xp 0 08:01 9", bad(Field::Start, "+1000")),
            (
                "1000-20000000000000000 r-xp 0 08:01 9",
                bad(Field::End, "20000000000000000"),
            ),
            ("1000-2000 r-xp 0x10 08:01 9", bad(Field::Offset, "0x10")),
            ("1000-2000 r-xp 0 zz:01 9", bad(Field::Device, "zz:01")),
            (
                "1000-2000 r-xp 0 08:1ffffffff 9",
                bad(Field::Device, "08:1ffffffff"),
            ),
            (
                "1000-2000 r-xp 0 08:01 9a /lib/a.so",
                bad(Field::Inode, "9a"),
            ),
            (
                "1000-2000 rwxq 0 08:01 9",
                LineErrorKind::BadPerms("rwxq".into()),
            ),
            (
                "1000-2000 xwrp 0 08:01 9",
                LineErrorKind::BadPerms("xwrp".into()),
            ),
            (
                "1000-2000 rwx 0 08:01 9",
                LineErrorKind::BadPerms("rwx".into()),
            ),
            (
                "1000-2000 rwxpp 0 08:01 9",
                LineErrorKind::BadPerms("rwxpp".into()),
            ),
            (
                "2000-1000 r-xp 0 08:01 9",
                LineErrorKind::InvertedRange {
                    start: 0x2000,
                    end: 0x1000,
                },
            ),
        ];
        for (line, expected) in cases {
            assert_eq!(error_kind(line), expected, "{line:?}");
        }
    }

    #[test]
    fn error_message_names_the_line() {
        let text =
            b"1000-2000 r-xp 00000000 08:01 9 /lib/a.so\n1000-2000 r-xp zz 08:01 9 /lib/b.so\n";
        let err = parse_maps(text).expect_err("second line is bad");
        assert_eq!(
            err.to_string(),
            "maps line 2 \"1000-2000 r-xp zz 08:01 9 /lib/b.so\": offset \"zz\" is not a valid number"
        );
        assert_eq!(err.number, 2);
    }

    #[test]
    fn whole_file() {
        let text = b"00400000-00401000 r--p 00000000 08:01 5 /bin/x\n\
00401000-00402000 r-xp 00001000 08:01 5 /bin/x\n\
7ffd5e3d6000-7ffd5e3d8000 r-xp 00000000 00:00 0 [vdso]\n";
        let mappings = parse_maps(text).expect("parses");
        assert_eq!(mappings.len(), 3);
        assert_eq!(mappings[1].offset, 0x1000);
        assert_eq!(mappings[2].path, MappingPath::Vdso);
        assert_eq!(parse_maps(b"").expect("empty is fine"), Vec::new());
    }

    #[test]
    fn dev_from_st_dev_matches_printed_form() {
        // makedev(0xfe, 0x01) and a device with a minor above 255.
        assert_eq!(
            Dev::from_st_dev(libc::makedev(0xfe, 1)),
            Dev {
                major: 0xfe,
                minor: 1
            }
        );
        assert_eq!(
            Dev::from_st_dev(libc::makedev(0x103, 0x12345)).to_string(),
            "103:12345"
        );
    }

    #[test]
    fn own_maps_parse() {
        let mappings = read_maps(std::process::id()).expect("reading our own maps");
        let exe = std::fs::read_link("/proc/self/exe").expect("our executable");
        assert!(
            mappings
                .iter()
                .any(|m| m.perms.exec && m.path.file_path() == Some(exe.as_path())),
            "our own executable is mapped executable: {mappings:#?}"
        );
    }

    #[test]
    fn missing_process_is_gone() {
        // pid_max is at most 2^22, so this pid cannot exist.
        let err = read_maps(u32::MAX).expect_err("no such process");
        assert!(
            matches!(err, MapsError::ProcessGone { pid: u32::MAX }),
            "{err:?}"
        );
    }
}
