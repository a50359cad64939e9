//! Finding the interpreter in a running process: which mapped file holds
//! it (`python3.X` or `libpython3.X.so`), where its `_PyRuntime` lies in
//! the process, and the layout of its version.

use std::{
    fs::File,
    ops::Range,
    path::{Path, PathBuf},
};

use stackscope_process_table::{elf, maps, table::bias};

use crate::{Interpreter, InterpreterError, Layout};

/// A CPython interpreter in a running process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FoundInterpreter {
    /// The mapped file that holds it, as the process sees it.
    pub path: PathBuf,
    pub interpreter: Interpreter,
    pub layout: Layout,
    /// Address of `_PyRuntime` in the process.
    pub runtime: u64,
    /// The code of `_PyEval_EvalFrameDefault` in the process, its split
    /// parts included (empty when the file has no symbol for it: no native
    /// frame is replaced).
    pub eval: Vec<Range<u64>>,
}

/// Why a process's interpreter could not be used.
#[derive(Debug, thiserror::Error)]
pub enum FindError {
    #[error("reading the process's mappings: {0}")]
    Maps(#[from] maps::MapsError),
    #[error("{path}: {source}")]
    Interpreter {
        path: PathBuf,
        #[source]
        source: InterpreterError,
    },
    #[error("{path}: CPython {}.{} is not read (3.10 to 3.14 are)", .version.0, .version.1)]
    Unsupported { path: PathBuf, version: (u8, u8) },
    #[error(
        "{path}: a free-threaded CPython {}.{} build: its frames are not read (objects, \
         frames and per-thread bytecode are laid out otherwise)",
        .version.0, .version.1
    )]
    FreeThreaded { path: PathBuf, version: (u8, u8) },
    #[error("{path}: no load segment covers its mappings")]
    NoBias { path: PathBuf },
    #[error(
        "{path}: its _Py_DebugOffsets put {field} at {published}, not at {known} as in the \
         CPython {}.{} this profiler reads: its frames are not read",
        .version.0, .version.1
    )]
    OffsetsDiffer {
        path: PathBuf,
        version: (u8, u8),
        field: &'static str,
        published: u64,
        known: u32,
    },
}

/// Whether a file's name says it may hold a CPython interpreter
/// (`python3.11`, `libpython3.12.so.1.0`).
pub fn named_like_interpreter(path: &Path) -> bool {
    path.file_name()
        .and_then(|name| name.to_str())
        .is_some_and(|name| name.starts_with("python") || name.starts_with("libpython"))
}

/// The interpreter mapped in process `pid` (under procfs at `proc_root`),
/// if any. Only files named like an interpreter (`python*`, `libpython*`)
/// are opened, each once, through the process's root (its container's
/// files).
pub fn find_in_process(proc_root: &Path, pid: u32) -> Result<Option<FoundInterpreter>, FindError> {
    let mappings = maps::read_maps_at(proc_root, pid)?;
    let mut tried: Vec<PathBuf> = Vec::new();
    for mapping in &mappings {
        let Some(path) = mapping.path.file_path() else {
            continue;
        };
        if !named_like_interpreter(path) || tried.iter().any(|seen| seen == path) {
            continue;
        }
        tried.push(path.to_path_buf());
        let in_root =
            PathBuf::from(format!("/proc/{pid}/root")).join(path.strip_prefix("/").unwrap_or(path));
        let Ok(file) = File::open(&in_root) else {
            continue;
        };
        let error = |source| FindError::Interpreter {
            path: path.to_path_buf(),
            source,
        };
        let Some(interpreter) = Interpreter::read(&file, path).map_err(error)? else {
            continue;
        };
        let layout = Layout::of_interpreter(&interpreter).ok_or(FindError::Unsupported {
            path: path.to_path_buf(),
            version: interpreter.version(),
        })?;
        // A build whose layout differs from the version's usual one (free-
        // threaded, patched, or configured otherwise) says so itself since
        // 3.13: its frames are not read rather than read wrong.
        if interpreter
            .debug_offsets
            .is_some_and(|published| published.free_threaded)
        {
            return Err(FindError::FreeThreaded {
                path: path.to_path_buf(),
                version: interpreter.version(),
            });
        }
        if let Some((field, published, known)) = interpreter
            .debug_offsets
            .and_then(|published| layout.disagreement(&published))
        {
            return Err(FindError::OffsetsDiffer {
                path: path.to_path_buf(),
                version: interpreter.version(),
                field,
                published,
                known,
            });
        }
        let segments = elf::read_summary(&file)
            .map(|summary| summary.load_segments)
            .unwrap_or_default();
        let bias = bias(mapping, &segments, 4096).ok_or(FindError::NoBias {
            path: path.to_path_buf(),
        })?;
        let eval = interpreter
            .eval
            .iter()
            .map(|code| code.start.wrapping_add(bias)..code.end.wrapping_add(bias))
            .collect();
        return Ok(Some(FoundInterpreter {
            path: path.to_path_buf(),
            runtime: interpreter.runtime.wrapping_add(bias),
            eval,
            interpreter,
            layout,
        }));
    }
    Ok(None)
}
