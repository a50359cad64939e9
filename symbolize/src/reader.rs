//! blazesym, set up once for every caller, its answers turned into
//! [`Lines`], and a panic in it turned into an error.

use std::{
    panic::AssertUnwindSafe,
    path::{Path, PathBuf},
};

use blazesym::symbolize::{
    self as blaze, CodeInfo, Input, Sym, Symbolized,
    evict::{self, Evict},
    source::Source,
};

use crate::{FrameLine, Lines, MAX_LINES, demangle, truncate_str};

/// How blazesym reads files, and how long the names it gives may be.
#[derive(Debug, Clone)]
pub struct ReaderOptions {
    /// Whether blazesym checks a file against its path again on every call
    /// (its default); off for paths that name one file for as long as
    /// they are read by.
    pub auto_reload: bool,
    /// Where blazesym looks for separate debug files (by build-id and debug
    /// link): `None` for its default (`/usr/lib/debug`, `/lib/debug`), an
    /// empty list for nowhere.
    pub debug_dirs: Option<Vec<PathBuf>>,
    /// The longest function or file name kept; longer ones are cut (on a
    /// character boundary).
    pub max_name_bytes: usize,
}

impl Default for ReaderOptions {
    /// blazesym's defaults, names kept whole.
    fn default() -> Self {
        Self {
            auto_reload: true,
            debug_dirs: None,
            max_name_bytes: usize::MAX,
        }
    }
}

/// Why blazesym gave no answer for a file.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// blazesym could not read the file (not ELF, malformed, I/O error).
    #[error("reading the object file")]
    Read(#[source] blazesym::Error),
    /// blazesym panicked on the file; its state was dropped and built
    /// afresh, so everything it had parsed is gone.
    #[error("the symbol reader panicked on the object file")]
    Panicked,
}

/// blazesym's state, set up as [`ReaderOptions`] say. Not `Send`, as
/// blazesym's own state is not.
pub struct Reader {
    blaze: blaze::Symbolizer,
    options: ReaderOptions,
}

impl std::fmt::Debug for Reader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reader")
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl Reader {
    pub fn new(options: ReaderOptions) -> Self {
        Self {
            blaze: new_blazesym(&options),
            options,
        }
    }

    /// Lines per address of `input` in `source`, index for index (empty:
    /// no symbol covers it). A panic in blazesym is [`ReadError::Panicked`],
    /// after its state was rebuilt (a panic may have left it half updated).
    pub fn read(
        &mut self,
        source: &Source<'_>,
        input: Input<&[u64]>,
    ) -> Result<Vec<Lines>, ReadError> {
        let blaze = &self.blaze;
        let max_name_bytes = self.options.max_name_bytes;
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
            blaze.symbolize(source, input).map(|found| {
                found
                    .iter()
                    .map(|symbolized| lines_of(symbolized, max_name_bytes))
                    .collect::<Vec<Lines>>()
            })
        }));
        match result {
            Ok(Ok(lines)) => Ok(lines),
            Ok(Err(err)) => Err(ReadError::Read(err)),
            Err(_) => {
                self.rebuild();
                Err(ReadError::Panicked)
            }
        }
    }

    /// Drops what blazesym parsed of the ELF file at `path` (nothing when it
    /// never read it).
    pub fn evict_elf(&mut self, path: &Path) {
        // Evicting a path blazesym never opened is no error, and no other
        // error is possible for an ELF path.
        let _ = self
            .blaze
            .evict(&Evict::Elf(evict::Elf::new(path.to_path_buf())));
    }

    /// Drops blazesym's whole state: what it parsed stays until then.
    pub fn rebuild(&mut self) {
        self.blaze = new_blazesym(&self.options);
    }
}

fn new_blazesym(options: &ReaderOptions) -> blaze::Symbolizer {
    let mut builder = blaze::Symbolizer::builder()
        .enable_auto_reload(options.auto_reload)
        .enable_code_info(true)
        .enable_inlined_fns(true)
        // Its demangler reads bare C names as type codes (`c` -> `char`);
        // names go through this crate's `demangle`, as every other name.
        .enable_demangling(false);
    if let Some(dirs) = &options.debug_dirs {
        builder = builder.set_debug_dirs(Some(dirs));
    }
    builder.build()
}

/// The lines of one blazesym answer, innermost function first.
fn lines_of(symbolized: &Symbolized<'_>, max_name_bytes: usize) -> Lines {
    let sym: &Sym<'_> = match symbolized {
        Symbolized::Sym(sym) => sym,
        // Every reason, `IgnoredError` (a failure for this address in a
        // file that could be read) included, is an address without a name:
        // asking again would get the same answer.
        Symbolized::Unknown(_) => return Lines::from([]),
    };
    // blazesym lists inlined calls outermost first, each with the location
    // inside it; the symbol's own code info is the call site of the first.
    let mut lines: Vec<FrameLine> = sym
        .inlined
        .iter()
        .rev()
        .take(MAX_LINES - 1)
        .map(|inlined| frame_line(&inlined.name, inlined.code_info.as_ref(), max_name_bytes))
        .collect();
    lines.push(frame_line(
        &sym.name,
        sym.code_info.as_deref(),
        max_name_bytes,
    ));
    lines.into()
}

fn frame_line(name: &str, code: Option<&CodeInfo<'_>>, max_name_bytes: usize) -> FrameLine {
    let (file, line) = code.map_or((String::new(), 0), |code| {
        (
            code.to_path().to_string_lossy().into_owned(),
            code.line.unwrap_or(0),
        )
    });
    FrameLine {
        function: truncate_str(&demangle(name), max_name_bytes).into(),
        file: truncate_str(&file, max_name_bytes).into(),
        line,
    }
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use blazesym::symbolize::source::Elf;
    use object::{Object as _, ObjectSection as _, ObjectSymbol as _};
    use stackscope_test_fixtures::{
        Fixture, split_debug::run_tool, symbol_file_offset as offset_of,
    };

    use super::*;

    /// `(start, end)` file offsets of function `name`.
    fn range_of(path: &Path, name: &str) -> (u64, u64) {
        let data = std::fs::read(path).expect("reading the fixture");
        let elf = object::File::parse(&*data).expect("parsing");
        let size = elf
            .symbols()
            .find(|symbol| symbol.name() == Ok(name))
            .expect("the symbol")
            .size();
        let start = offset_of(path, name, 0);
        (start, start + size)
    }

    fn functions(lines: &[FrameLine]) -> Vec<&str> {
        lines.iter().map(|line| &*line.function).collect()
    }

    /// Lines of the file offsets `offsets` of the ELF file at `path`, with
    /// the options given.
    fn read_with(options: ReaderOptions, path: &Path, offsets: &[u64]) -> Vec<Lines> {
        Reader::new(options)
            .read(&Source::Elf(Elf::new(path)), Input::FileOffset(offsets))
            .expect("reading the file")
    }

    fn read(path: &Path, offsets: &[u64]) -> Vec<Lines> {
        read_with(ReaderOptions::default(), path, offsets)
    }

    /// Builds a program whose `outer` holds an inlined call to `inner`,
    /// with `gcc_args` added, then `post` (objcopy arguments, none: used as
    /// built) applied to the binary.
    fn inlined_program(dir: &Path, gcc_args: &[&str], post: &[&str]) -> PathBuf {
        let source = dir.join("inlined.c");
        std::fs::write(
            &source,
            "static volatile int sink;\n\
             static inline __attribute__((always_inline)) int inner(int x) {\n\
             \x20   sink += x;\n\
             \x20   return sink * 3;\n\
             }\n\
             __attribute__((noinline)) int outer(int x) {\n\
             \x20   int r = inner(x);\n\
             \x20   sink += r;\n\
             \x20   return r;\n\
             }\n\
             int main(void) { return outer(1); }\n",
        )
        .expect("writing the source");
        let binary = dir.join("inlined");
        run_tool(
            Command::new("gcc")
                .args(["-O2", "-g", "-fomit-frame-pointer"])
                .args(gcc_args)
                .arg(&source)
                .arg("-o")
                .arg(&binary),
        );
        if post.is_empty() {
            return binary;
        }
        let processed = dir.join("inlined.post");
        run_tool(
            Command::new("objcopy")
                .args(post)
                .arg(&binary)
                .arg(&processed),
        );
        processed
    }

    /// `outer`'s addresses are named, the inlined `inner` first with its
    /// file and line, then `outer` with the call site's line.
    fn assert_inlined_lines(binary: &Path) {
        let (start, end) = range_of(binary, "outer");
        let offsets: Vec<u64> = (start..end).collect();
        let found = read(binary, &offsets);
        let inlined = found
            .iter()
            .find(|lines| lines.len() == 2)
            .unwrap_or_else(|| panic!("no address in the inlined call: {:?}", found.first()));
        assert_eq!(functions(inlined), ["inner", "outer"]);
        assert!(inlined[0].file.ends_with("inlined.c"), "{inlined:?}");
        assert!(
            (3..=4).contains(&inlined[0].line),
            "line in inner: {inlined:?}"
        );
        assert_eq!(inlined[1].line, 7, "the call site in outer: {inlined:?}");
        assert!(
            found
                .iter()
                .all(|lines| lines.last().map(|l| &*l.function) == Some("outer")),
            "every address is in outer"
        );
    }

    #[test]
    fn dwarf_lines_and_inlined_functions_come_innermost_first() {
        let dir = tempfile::tempdir().expect("temporary directory");
        assert_inlined_lines(&inlined_program(dir.path(), &[], &[]));
    }

    #[test]
    fn compressed_dwarf_names_as_the_uncompressed_one() {
        // gcc's -gz (SHF_COMPRESSED, zlib) and objcopy's zstd: blazesym's
        // zlib and zstd features.
        for (gcc, objcopy) in [
            (&["-gz=zlib"][..], &[][..]),
            (&[], &["--compress-debug-sections=zstd"]),
        ] {
            let dir = tempfile::tempdir().expect("temporary directory");
            let binary = inlined_program(dir.path(), gcc, objcopy);
            let data = std::fs::read(&binary).expect("reading the binary");
            let elf = object::File::parse(&*data).expect("ELF");
            let debug_info = elf.section_by_name(".debug_info").expect(".debug_info");
            assert_ne!(
                debug_info
                    .compressed_file_range()
                    .expect("its range")
                    .format,
                object::CompressionFormat::None,
                "{gcc:?} {objcopy:?}"
            );
            assert_inlined_lines(&binary);
        }
    }

    #[test]
    fn zdebug_dwarf_names_from_the_symbol_table_without_lines() {
        // The pre-SHF_COMPRESSED GNU form (`.zdebug_*`, objcopy's
        // zlib-gnu, gcc's -gz=zlib-gnu): blazesym 0.2 does not read it,
        // so its DWARF is not used; the symbol table still names the
        // function. Pinned so a blazesym that learns it shows here.
        let dir = tempfile::tempdir().expect("temporary directory");
        let binary = inlined_program(dir.path(), &[], &["--compress-debug-sections=zlib-gnu"]);
        let (start, end) = range_of(&binary, "outer");
        let offsets: Vec<u64> = (start..end).collect();
        let found = read(&binary, &offsets);
        assert!(
            found
                .iter()
                .all(|lines| functions(lines) == ["outer"] && lines[0].line == 0),
            "{:?}",
            found.first()
        );
    }

    #[test]
    fn c_names_are_kept_and_cpp_names_demangled_without_parameters() {
        let fixture = Fixture::compile("call_chain", &[]);
        let names = ["c", "b", "a", "main"];
        let offsets: Vec<u64> = names
            .iter()
            .map(|name| offset_of(&fixture.path, name, 2))
            .collect();
        let found = read(&fixture.path, &offsets);
        let found: Vec<Vec<&str>> = found.iter().map(|lines| functions(lines)).collect();
        // Not `char`, `bool`, `signed char`: C names are not demangled.
        assert_eq!(found, names.map(|name| vec![name]));

        let fixture = Fixture::cpp_template_chain();
        let offset = offset_of(&fixture.path, "_ZN6WorkerIiE3runEv", 1);
        let found = read(&fixture.path, &[offset]);
        assert_eq!(functions(&found[0]), ["Worker<int>::run"]);
    }

    #[test]
    fn names_are_cut_to_the_bound_on_a_character_boundary() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let binary = inlined_program(dir.path(), &[], &[]);
        let (start, _) = range_of(&binary, "outer");
        let options = ReaderOptions {
            max_name_bytes: 3,
            ..ReaderOptions::default()
        };
        let whole = read(&binary, &[start]);
        let cut = read_with(options, &binary, &[start]);
        assert!(!whole[0].is_empty());
        assert_eq!(whole[0].len(), cut[0].len());
        for (whole, cut) in whole[0].iter().zip(cut[0].iter()) {
            assert_eq!(&*cut.function, &whole.function[..3], "{cut:?}");
            assert_eq!(&*cut.file, &whole.file[..3], "{cut:?}");
            assert_eq!(cut.line, whole.line);
        }
        assert_eq!(truncate_str("aé", 2), "a");
    }

    #[test]
    fn an_unreadable_file_is_an_error_and_unknown_addresses_are_empty() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let garbage = dir.path().join("garbage");
        std::fs::write(&garbage, [0x5a; 4096]).expect("writing");
        let mut reader = Reader::new(ReaderOptions::default());
        let source = Source::Elf(Elf::new(&garbage));
        assert!(matches!(
            reader.read(&source, Input::FileOffset(&[0x10])),
            Err(ReadError::Read(_))
        ));
        let fixture = Fixture::compile("call_chain", &[]);
        let found = read(&fixture.path, &[0]);
        assert!(found[0].is_empty(), "{found:?}");
    }
}
