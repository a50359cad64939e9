//! Kernel frame names from `/proc/kallsyms`, and the kernel's build-ids.
//!
//! Owns parsing kallsyms into a compact sorted table (function symbols
//! only, module names kept) and reading the build-id notes of the kernel
//! (`/sys/kernel/notes`) and of modules (`/sys/module/<name>/notes`). Does
//! not decide when to reload (the agent's symbolizer does) and does not
//! look at anything but these files.
//!
//! kallsyms is read directly rather than through blazesym's kernel source:
//! the module column names the mapping a kernel frame is shipped in, and
//! the table is kept at 16 bytes per symbol plus the names (a few MB for the
//! 100-200k function symbols of a distribution kernel).

use std::{collections::HashMap, io, path::Path, sync::Arc};

/// Kernel addresses start here on x86_64; kallsyms lines below it (and the
/// zeros printed when `kptr_restrict` hides addresses) are not code.
const KERNEL_SPACE: u64 = 0xffff_8000_0000_0000;

/// Longest symbol name kept; the kernel's `KSYM_NAME_LEN` is 512.
const MAX_NAME_LEN: usize = 1024;

/// One function symbol; the name lives in [`KernelSymbols::names`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct KernelSymbol {
    address: u64,
    name_start: u32,
    name_len: u16,
    /// Index into `modules` plus one; 0 for the kernel image itself.
    module: u16,
}

const _: () = assert!(std::mem::size_of::<KernelSymbol>() == 16);

/// A symbol found for an address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelName<'a> {
    pub function: &'a str,
    /// The module the function is in; `None` for the kernel image.
    pub module: Option<&'a Arc<str>>,
}

/// The kernel's function symbols, sorted by address.
#[derive(Debug, Default)]
pub struct KernelSymbols {
    symbols: Vec<KernelSymbol>,
    names: String,
    modules: Vec<Arc<str>>,
    /// Where each loaded module's core lies, `[start, end)`, by the index
    /// in `modules` (from `/proc/modules`; `None` for names it does not
    /// list, such as `bpf`): an address past a module's end belongs to no
    /// symbol of it (a module loaded since, typically).
    extents: Vec<Option<(u64, u64)>>,
}

/// Bytes read from kallsyms at a time (see [`KernelSymbols::load`]).
const READ_BYTES: usize = 256 * 1024;

/// A hex number of at most 16 digits, no prefix; `None` for anything else.
fn parse_hex(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() || digits.len() > 16 {
        return None;
    }
    digits.iter().try_fold(0u64, |value, &digit| {
        let nibble = (digit as char).to_digit(16)?;
        Some(value << 4 | u64::from(nibble))
    })
}

/// `[start, end)` of each module `/proc/modules` lists (`name size refs
/// deps state address ...` per line); lines of another shape, and modules
/// whose address is hidden (0), are left out.
pub fn parse_module_extents(text: &str) -> HashMap<&str, (u64, u64)> {
    text.lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let name = fields.next()?;
            let size: u64 = fields.next()?.parse().ok()?;
            // Past refs, deps and state.
            let address = fields.nth(3)?.strip_prefix("0x")?;
            let start = u64::from_str_radix(address, 16).ok()?;
            (start >= KERNEL_SPACE).then_some((name, (start, start.checked_add(size)?)))
        })
        .collect()
}

impl KernelSymbols {
    /// Reads and parses a kallsyms file, bounding module symbols by the
    /// module extents in `modules` (`/proc/modules`) when it is readable.
    pub fn load(path: &Path, modules: &Path) -> io::Result<Self> {
        // Streamed: the whole text (8 MB on a distribution kernel) would
        // double the agent's peak heap for the moment of the parse. Read in
        // large pieces: each read is a system call through seq_file.
        let file = std::fs::File::open(path)?;
        let mut table = Self::parse(io::BufReader::with_capacity(READ_BYTES, file))?;
        if let Ok(text) = std::fs::read_to_string(modules) {
            table.bound_modules(&parse_module_extents(&text));
        }
        Ok(table)
    }

    /// Bounds module symbols by `extents` (by module name).
    pub fn bound_modules(&mut self, extents: &HashMap<&str, (u64, u64)>) {
        self.extents = self
            .modules
            .iter()
            .map(|name| extents.get(&**name).copied())
            .collect();
    }

    /// Parses kallsyms text (`<hex address> <type> <name>[\t[<module>]]`
    /// per line). Lines that are not function symbols, or not of that
    /// shape, are skipped: the table is best effort; only a failed read is
    /// an error.
    pub fn parse(mut text: impl io::BufRead) -> io::Result<Self> {
        let mut table = Self::default();
        let mut module_index: HashMap<String, u16> = HashMap::new();
        // Bytes, not a String per line: 120k lines of UTF-8 checks and
        // splitting were a third of the load, next to the kernel's own
        // formatting. Only the names kept are checked.
        let mut line = Vec::new();
        loop {
            line.clear();
            if text.read_until(b'\n', &mut line)? == 0 {
                break;
            }
            let mut fields = line
                .split(u8::is_ascii_whitespace)
                .filter(|field| !field.is_empty());
            let (Some(address), Some(kind), Some(name)) =
                (fields.next(), fields.next(), fields.next())
            else {
                continue;
            };
            // Text symbols: t/T, and weak ones (w/W), which are functions in
            // kallsyms (weak data is not listed).
            if !matches!(kind, b"t" | b"T" | b"w" | b"W") || name.len() > MAX_NAME_LEN {
                continue;
            }
            let Some(address) = parse_hex(address) else {
                continue;
            };
            if address < KERNEL_SPACE {
                continue;
            }
            let Ok(name) = std::str::from_utf8(name) else {
                continue;
            };
            let module = match fields.next() {
                Some(module) => {
                    let Ok(module) = std::str::from_utf8(module) else {
                        continue;
                    };
                    let module = module.trim_start_matches('[').trim_end_matches(']');
                    match module_index.get(module) {
                        Some(&index) => index,
                        None => {
                            let Ok(index) = u16::try_from(table.modules.len() + 1) else {
                                continue;
                            };
                            table.modules.push(module.into());
                            module_index.insert(module.to_string(), index);
                            index
                        }
                    }
                }
                None => 0,
            };
            let Ok(name_start) = u32::try_from(table.names.len()) else {
                break;
            };
            table.names.push_str(name);
            table.symbols.push(KernelSymbol {
                address,
                name_start,
                // Cannot truncate: checked against MAX_NAME_LEN above.
                name_len: name.len() as u16,
                module,
            });
        }
        // Of aliases at one address the last listed wins: kallsyms lists
        // section markers (`_text`, `_stext`) before the function that
        // starts there. Stable sort, then dedup from the back.
        table.symbols.sort_by_key(|symbol| symbol.address);
        table.symbols.reverse();
        table.symbols.dedup_by_key(|symbol| symbol.address);
        table.symbols.reverse();
        table.symbols.shrink_to_fit();
        table.names.shrink_to_fit();
        Ok(table)
    }

    /// No symbol was readable (no kallsyms, or addresses hidden by
    /// `kptr_restrict`).
    pub fn is_empty(&self) -> bool {
        self.symbols.is_empty()
    }

    pub fn len(&self) -> usize {
        self.symbols.len()
    }

    /// The function symbol at or below `address`. kallsyms has no sizes:
    /// an address past a module's last function is attributed to it only
    /// when the module's extent is unknown; past a known extent it has no
    /// name (see [`KernelSymbols::bound_modules`]).
    pub fn lookup(&self, address: u64) -> Option<KernelName<'_>> {
        let at = self.symbols.partition_point(|s| s.address <= address);
        let symbol = self.symbols.get(at.checked_sub(1)?)?;
        let start = symbol.name_start as usize;
        let function = self
            .names
            .get(start..start + usize::from(symbol.name_len))?;
        let index = usize::from(symbol.module).checked_sub(1);
        if let Some(Some((_, end))) = index.and_then(|index| self.extents.get(index))
            && address >= *end
        {
            return None;
        }
        let module = index.and_then(|index| self.modules.get(index));
        Some(KernelName { function, module })
    }
}

/// `NT_GNU_BUILD_ID`.
const NT_GNU_BUILD_ID: u32 = 3;

/// The GNU build-id in a sequence of ELF notes (the contents of a
/// `PT_NOTE` segment, `/sys/kernel/notes`), as lower-case hex.
pub fn build_id_from_notes(mut notes: &[u8]) -> Option<String> {
    let word = |bytes: &[u8], at: usize| -> Option<u32> {
        Some(u32::from_ne_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
    };
    let padded =
        |len: u32| -> Option<usize> { usize::try_from(len).ok()?.checked_next_multiple_of(4) };
    while notes.len() >= 12 {
        let name_len = word(notes, 0)?;
        let desc_len = word(notes, 4)?;
        let kind = word(notes, 8)?;
        let name_end = 12usize.checked_add(padded(name_len)?)?;
        let desc_end = name_end.checked_add(padded(desc_len)?)?;
        let name = notes.get(12..12 + usize::try_from(name_len).ok()?)?;
        let desc = notes.get(name_end..name_end + usize::try_from(desc_len).ok()?)?;
        if kind == NT_GNU_BUILD_ID && name == b"GNU\0" && !desc.is_empty() {
            return Some(desc.iter().map(|byte| format!("{byte:02x}")).collect());
        }
        notes = notes.get(desc_end..)?;
    }
    None
}

/// The running kernel's build-id, or `None` when it has none or
/// `/sys/kernel/notes` is not readable.
pub fn kernel_build_id(sys: &Path) -> Option<String> {
    build_id_from_notes(&std::fs::read(sys.join("kernel/notes")).ok()?)
}

/// A loaded module's build-id, from its notes in sysfs.
pub fn module_build_id(sys: &Path, module: &str) -> Option<String> {
    // A name from kallsyms is used as a path component: keep it one.
    if module.is_empty() || module.contains('/') || module.starts_with('.') {
        return None;
    }
    let notes = sys
        .join("module")
        .join(module)
        .join("notes/.note.gnu.build-id");
    build_id_from_notes(&std::fs::read(notes).ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    const KALLSYMS: &str = "\
0000000000000000 A fixed_percpu_data
ffffffff81000000 T _text
ffffffff81000000 T startup_64
ffffffff81001000 t do_one_initcall
ffffffff81002000 D some_data
ffffffff81003000 W weak_function
not a line
ffffffff8100zz00 T bad_address
ffffffffc0a01000 t nft_do_chain\t[nf_tables]
ffffffffc0a02000 T nft_register\t[nf_tables]
ffffffffc0b00000 t ext4_map\t[ext4]
";

    #[test]
    fn parses_functions_with_their_modules() {
        let table = KernelSymbols::parse(KALLSYMS.as_bytes()).unwrap();
        assert_eq!(
            table.len(),
            6,
            "data, absolute and malformed lines skipped, aliases merged"
        );
        let name = |address| {
            table
                .lookup(address)
                .map(|n| (n.function.to_string(), n.module.map(|m| m.to_string())))
        };
        assert_eq!(name(0xffff_ffff_8000_0000), None, "below the first symbol");
        // Aliases at one address: the last listed.
        assert_eq!(
            name(0xffff_ffff_8100_0000),
            Some(("startup_64".into(), None))
        );
        assert_eq!(
            name(0xffff_ffff_8100_1234),
            Some(("do_one_initcall".into(), None))
        );
        assert_eq!(
            name(0xffff_ffff_8100_2000),
            Some(("do_one_initcall".into(), None)),
            "data symbols do not end a function"
        );
        assert_eq!(
            name(0xffff_ffff_8100_3001),
            Some(("weak_function".into(), None))
        );
        assert_eq!(
            name(0xffff_ffff_c0a0_1010),
            Some(("nft_do_chain".into(), Some("nf_tables".into())))
        );
        assert_eq!(
            name(0xffff_ffff_c0b0_0001),
            Some(("ext4_map".into(), Some("ext4".into())))
        );
    }

    #[test]
    fn lines_that_are_not_text_or_not_hex_are_skipped_alone() {
        let mut text = b"ffffffff81000000 T first\n".to_vec();
        text.extend_from_slice(b"ffffffff81001000 t bad_\xff_name\n");
        text.extend_from_slice(b"1ffffffff81002000 t seventeen_digits\n");
        text.extend_from_slice(b"ffffffff81003000 t last\t[mod\xff]\n");
        text.extend_from_slice(b"ffffffff81004000 t after");
        let table = KernelSymbols::parse(&text[..]).unwrap();
        assert_eq!(table.len(), 2);
        let name = |address| table.lookup(address).map(|n| n.function.to_string());
        assert_eq!(name(0xffff_ffff_8100_3000), Some("first".into()));
        assert_eq!(
            name(0xffff_ffff_8100_4001),
            Some("after".into()),
            "a last line without a newline"
        );
    }

    #[test]
    fn hidden_addresses_give_an_empty_table() {
        let hidden = "0000000000000000 T _text\n0000000000000000 t do_one_initcall\n";
        let table = KernelSymbols::parse(hidden.as_bytes()).unwrap();
        assert!(table.is_empty());
        assert_eq!(table.lookup(0xffff_ffff_8100_0000), None);
    }

    fn note(name: &[u8], kind: u32, desc: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&(name.len() as u32).to_ne_bytes());
        out.extend_from_slice(&(desc.len() as u32).to_ne_bytes());
        out.extend_from_slice(&kind.to_ne_bytes());
        out.extend_from_slice(name);
        out.resize(out.len().next_multiple_of(4), 0);
        out.extend_from_slice(desc);
        out.resize(out.len().next_multiple_of(4), 0);
        out
    }

    #[test]
    fn finds_the_build_id_among_notes() {
        let mut notes = note(b"Xen\0", 1, &[1, 2, 3]);
        notes.extend(note(b"GNU\0", 1, &[9; 16]));
        notes.extend(note(
            b"GNU\0",
            NT_GNU_BUILD_ID,
            &[0x00, 0xab, 0x1f, 0xff, 0x10],
        ));
        assert_eq!(build_id_from_notes(&notes).as_deref(), Some("00ab1fff10"));
    }

    #[test]
    fn truncated_or_garbage_notes_are_none() {
        let notes = note(b"GNU\0", NT_GNU_BUILD_ID, &[0xab; 20]);
        for len in 0..notes.len() {
            assert_eq!(build_id_from_notes(&notes[..len]), None, "{len} bytes");
        }
        let mut huge = notes.clone();
        huge[4..8].copy_from_slice(&u32::MAX.to_ne_bytes());
        assert_eq!(build_id_from_notes(&huge), None);
    }

    #[test]
    fn module_names_are_not_paths() {
        let sys = Path::new("/sys");
        assert_eq!(module_build_id(sys, "../../etc"), None);
        assert_eq!(module_build_id(sys, ""), None);
    }

    #[test]
    #[ignore = "needs root (others read zero addresses): run by `cargo xtask test`"]
    fn reads_this_kernels_symbols_when_allowed() {
        // Root sees addresses, as the agent runs; others see zeros.
        stackscope_test_fixtures::require_root("reading addresses from /proc/kallsyms");
        let table = KernelSymbols::load(Path::new("/proc/kallsyms"), Path::new("/proc/modules"))
            .expect("reading /proc/kallsyms");
        let restricted = std::fs::read_to_string("/proc/sys/kernel/kptr_restrict")
            .is_ok_and(|level| level.trim() == "2");
        if restricted {
            // Zeros for root too: no names rather than wrong ones.
            assert!(table.is_empty(), "{} symbols", table.len());
            return;
        }
        assert!(table.len() > 1000, "{} symbols", table.len());
        let name = table.lookup(table.symbols[0].address + 1);
        assert!(name.is_some_and(|n| !n.function.is_empty()));
    }
}
