//! A C program built with `-g` and split as distributions ship it: the
//! binary stripped, its symbols and DWARF in a separate debug file
//! (`objcopy --only-keep-debug`), matched by build-id. For the tests of
//! naming stripped binaries, on the node and in the collector.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

/// See the module documentation. Removed with its temporary directory.
pub struct SplitDebug {
    dir: tempfile::TempDir,
    /// The binary as linked, symbols and DWARF inside.
    pub full: PathBuf,
    /// The separate debug file, alone in its own directory (`debug/`).
    pub debug: PathBuf,
    /// The binary with every symbol and DWARF section removed.
    pub stripped: PathBuf,
    /// Lower-case hex.
    pub build_id: String,
}

/// Runs a build tool, failing the test with its output if it fails.
pub fn run_tool(command: &mut Command) {
    let out = command
        .output()
        .unwrap_or_else(|err| panic!("{command:?}: {err}"));
    assert!(
        out.status.success(),
        "{command:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The GNU build-id of the ELF file at `path` (lower-case hex).
pub fn build_id(path: &Path) -> String {
    let data = std::fs::read(path).unwrap_or_else(|err| panic!("{}: {err}", path.display()));
    let elf = object::File::parse(&*data).expect("an ELF file");
    use object::Object as _;
    elf.build_id()
        .expect("readable notes")
        .expect("a build-id note")
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

impl SplitDebug {
    /// Builds `tests/fixtures/<name>.c` with `args`, `-g` and a build-id.
    pub fn fixture(name: &str, args: &[&str]) -> Self {
        let source = super::fixtures_dir().join(format!("{name}.c"));
        Self::build_in(
            tempfile::tempdir().expect("a temporary directory"),
            name,
            &source,
            args,
        )
    }

    /// Builds the C program `source` (its text) as `name`.
    pub fn from_source(name: &str, source: &str, args: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join(format!("{name}.c"));
        std::fs::write(&path, source).expect("writing the source");
        Self::build_in(dir, name, &path, args)
    }

    fn build_in(dir: tempfile::TempDir, name: &str, source: &Path, args: &[&str]) -> Self {
        let full = dir.path().join(format!("{name}.full"));
        let debug_dir = dir.path().join("debug");
        std::fs::create_dir(&debug_dir).expect("creating debug/");
        let debug = debug_dir.join(format!("{name}.debug"));
        let stripped = dir.path().join(name);
        run_tool(
            Command::new("gcc")
                .arg(source)
                .args(args)
                .args(["-g", "-Wl,--build-id"])
                .arg("-o")
                .arg(&full),
        );
        run_tool(
            Command::new("objcopy")
                .arg("--only-keep-debug")
                .arg(&full)
                .arg(&debug),
        );
        run_tool(
            Command::new("strip")
                .arg("--strip-all")
                .arg(&full)
                .arg("-o")
                .arg(&stripped),
        );
        let build_id = build_id(&full);
        Self {
            dir,
            full,
            debug,
            stripped,
            build_id,
        }
    }

    /// The temporary directory everything lives in.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}
