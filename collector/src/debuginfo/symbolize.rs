//! Names stored frames when a profile is read: a frame of a file with a
//! build-id that the node could not name (a stripped binary) is looked up in
//! that build-id's debuginfo from the store, or from debuginfod, and
//! replaced by one frame per function (inlined ones first, with file and
//! line where DWARF has them). Nothing is written back: a profile recorded
//! before its debuginfo arrived is named as soon as it arrives.
//!
//! A stored Go binary's frames that blazesym leaves unnamed (a Go binary
//! stripped of its symbol table and DWARF) are named from the Go runtime's
//! function table, `.gopclntab`, which such binaries keep.
//!
//! Owns the name cache (by build-id and file offset, bounded), which stored
//! files blazesym has parsed, and the Go function tables read from them. A
//! frame that stays unknown keeps its `[unknown] <binary>+0x<offset>` name:
//! it is never guessed. blazesym's set-up and its answers as lines, the
//! Go table's lookups and demangling are `stackscope_symbolize`'s, shared
//! with the agent.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    path::PathBuf,
    sync::{Arc, Mutex, PoisonError, mpsc},
};

use stackscope_profile::model::{CodeAddress, Frame, StackSamples};
use stackscope_symbolize::{
    Lines, ReadError, Reader, ReaderOptions,
    blazesym::symbolize::{
        Input,
        source::{Elf, Source},
    },
    go::{GoFunctions, GoNames, GoTableCache},
};
use stackscope_telemetry::StateSize;
use tokio::sync::oneshot;

use super::{DebuginfoStore, ElfContent, check_elf, debuginfod::Debuginfod};

/// Names kept, by (build-id, file offset): each a few frames.
const MAX_CACHED_NAMES: usize = 1 << 20;

/// Files blazesym keeps parsed before its state is dropped and rebuilt.
const MAX_PARSED_FILES: usize = 64;
/// Bytes of Go function tables kept at once (the largest Go programs have
/// tables of tens of MB); beyond, all are dropped and read again.
const MAX_GO_TABLE_BYTES: usize = 256 << 20;

/// Stored files whose checks are remembered.
const MAX_CHECKED_FILES: usize = 4096;

/// See the module documentation. blazesym's state is not `Send`: it lives
/// on one thread of its own, which answers lookups in turn.
pub struct Symbolizer {
    store: Arc<dyn DebuginfoStore>,
    debuginfod: Option<Arc<Debuginfod>>,
    requests: mpsc::Sender<Request>,
    /// The thread's cache sizes, as of its last request.
    sizes: Arc<Mutex<Vec<StateSize>>>,
}

/// The frames of one named address, innermost first.
type NamedFrames = Arc<[Arc<Frame>]>;

/// Found names, by build-id, then file offset.
type Names = HashMap<String, HashMap<u64, NamedFrames>>;

struct Request {
    wanted: Wanted,
    reply: oneshot::Sender<Names>,
}

struct State {
    store: Arc<dyn DebuginfoStore>,
    reader: Reader,
    /// The files blazesym has parsed since it was (re)built.
    parsed: HashSet<PathBuf>,
    /// Each stored file and what it holds, once checked.
    files: HashMap<String, (PathBuf, ElfContent)>,
    /// By build-id, then file offset; `None`: the file was read and no
    /// symbol covers the address.
    names: HashMap<String, HashMap<u64, Option<NamedFrames>>>,
    /// Entries of `names`, all build-ids together.
    cached: usize,
    /// Go function tables by build-id (`None`: the stored file has none).
    go: GoTableCache<String>,
}

/// blazesym's defaults (a stored file is read by its own path, and
/// blazesym looks for debug files where it looks by default), names
/// kept whole.
fn reader_options() -> ReaderOptions {
    ReaderOptions::default()
}

/// The distinct unnamed frames of a profile, by build-id.
type Wanted = BTreeMap<String, Vec<CodeAddress>>;

/// The symbolizer thread stopped (it panicked outside blazesym).
#[derive(Debug, thiserror::Error)]
#[error("the symbolizer thread stopped")]
pub struct SymbolizerGone;

impl Symbolizer {
    /// Starts the symbolizer's thread.
    pub fn start(
        store: Arc<dyn DebuginfoStore>,
        debuginfod: Option<Arc<Debuginfod>>,
    ) -> std::io::Result<Self> {
        let (requests, incoming) = mpsc::channel::<Request>();
        let thread_store = Arc::clone(&store);
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let thread_sizes = Arc::clone(&sizes);
        std::thread::Builder::new()
            .name("symbolizer".into())
            .spawn(move || {
                let mut state = State {
                    store: thread_store,
                    reader: Reader::new(reader_options()),
                    parsed: HashSet::new(),
                    files: HashMap::new(),
                    names: HashMap::new(),
                    cached: 0,
                    go: GoTableCache::new(MAX_PARSED_FILES, MAX_GO_TABLE_BYTES),
                };
                // Ends when the symbolizer (the last sender) is dropped.
                for request in incoming {
                    let names = state.lookup(request.wanted);
                    let _ = request.reply.send(names);
                    *thread_sizes.lock().unwrap_or_else(PoisonError::into_inner) = state.sizes();
                }
            })?;
        Ok(Self {
            store,
            debuginfod,
            requests,
            sizes,
        })
    }

    /// The caches naming keeps (as of the last query that named frames)
    /// and debuginfod's.
    pub fn state_sizes(&self, out: &mut Vec<StateSize>) {
        out.extend_from_slice(&self.sizes.lock().unwrap_or_else(PoisonError::into_inner));
        if let Some(debuginfod) = &self.debuginfod {
            debuginfod.state_sizes(out);
        }
    }

    /// `samples` with every frame the debuginfo at hand names replaced by
    /// its functions. Build-ids the store lacks are asked of debuginfod
    /// first, waiting at most its query wait.
    pub async fn name(&self, samples: StackSamples) -> Result<StackSamples, SymbolizerGone> {
        let wanted = wanted(&samples);
        if wanted.is_empty() {
            return Ok(samples);
        }
        if let Some(debuginfod) = &self.debuginfod {
            let missing: Vec<String> = wanted
                .keys()
                .filter(|build_id| self.store.get(build_id).is_none())
                .cloned()
                .collect();
            if !missing.is_empty() {
                debuginfod.fetch_into(&self.store, missing).await;
            }
        }
        let (reply, names) = oneshot::channel();
        self.requests
            .send(Request { wanted, reply })
            .map_err(|_| SymbolizerGone)?;
        let names = names.await.map_err(|_| SymbolizerGone)?;
        tokio::task::spawn_blocking(move || replace_frames(samples, &names))
            .await
            .map_err(|_| SymbolizerGone)
    }
}

impl State {
    fn sizes(&self) -> Vec<StateSize> {
        vec![
            StateSize::entries("symbol_names", self.cached, Some(MAX_CACHED_NAMES)),
            StateSize::entries(
                "symbolizer_files",
                self.files.len(),
                Some(MAX_CHECKED_FILES),
            ),
            StateSize::entries(
                "symbolizer_parsed",
                self.parsed.len(),
                Some(MAX_PARSED_FILES),
            ),
            StateSize::entries("go_tables", self.go.len(), Some(self.go.limits().0))
                .with_bytes(self.go.bytes(), Some(self.go.limits().1)),
        ]
    }

    /// Names for `wanted` from the cache and the store's files.
    fn lookup(&mut self, wanted: Wanted) -> Names {
        let mut found = Names::new();
        for (build_id, addresses) in wanted {
            let known = self.names.get(&build_id);
            let mut named = HashMap::new();
            let mut misses = Vec::new();
            for code in addresses {
                match known.and_then(|known| known.get(&code.file_offset)) {
                    Some(Some(frames)) => {
                        named.insert(code.file_offset, Arc::clone(frames));
                    }
                    Some(None) => {}
                    None => misses.push(code),
                }
            }
            if !misses.is_empty() {
                self.read_misses(&build_id, &misses, &mut named);
            }
            if !named.is_empty() {
                found.insert(build_id, named);
            }
        }
        found
    }

    /// Reads `misses` from `build_id`'s stored file (if there is one) into
    /// the cache and `named`.
    fn read_misses(
        &mut self,
        build_id: &str,
        misses: &[CodeAddress],
        named: &mut HashMap<u64, NamedFrames>,
    ) {
        let Some((path, content)) = self.file(build_id) else {
            return;
        };
        // A binary is read at its file offsets; a separate debug file keeps
        // only addresses, so frames whose node sent no code segments
        // cannot be placed in it.
        let usable: Vec<(u64, u64)> = misses
            .iter()
            .filter_map(|code| {
                let address = if content.holds_code {
                    code.file_offset
                } else {
                    code.vaddr?
                };
                Some((code.file_offset, address))
            })
            .collect();
        let addresses: Vec<u64> = usable.iter().map(|(_, address)| *address).collect();
        let input = if content.holds_code {
            Input::FileOffset(&addresses[..])
        } else {
            Input::VirtOffset(&addresses[..])
        };
        let lines = self.read(&path, input);
        let Some(lines) = self.with_go_names(build_id, &path, content, &usable, lines) else {
            return;
        };
        if self.cached + lines.len() > MAX_CACHED_NAMES {
            self.names.clear();
            self.cached = 0;
        }
        self.cached += lines.len();
        let cache = self.names.entry(build_id.to_owned()).or_default();
        for ((file_offset, _), lines) in usable.into_iter().zip(lines) {
            let frames = (!lines.is_empty()).then(|| frames_of(&lines));
            if let Some(frames) = &frames {
                named.insert(file_offset, Arc::clone(frames));
            }
            cache.insert(file_offset, frames);
        }
    }

    /// `found` (blazesym's lines per address of `usable`, `None` when it
    /// failed on the file) with the addresses it leaves unnamed named from
    /// the file's Go function table, when it is a Go binary.
    fn with_go_names(
        &mut self,
        build_id: &str,
        path: &std::path::Path,
        content: ElfContent,
        usable: &[(u64, u64)],
        found: Option<Vec<Lines>>,
    ) -> Option<Vec<Lines>> {
        if found
            .as_ref()
            .is_some_and(|found| found.iter().all(|lines| !lines.is_empty()))
        {
            return found;
        }
        let Some(functions) = self.go_functions(build_id, path) else {
            return found;
        };
        let Some(go) = GoNames::new(&functions, usize::MAX) else {
            return found;
        };
        let mut found = found.unwrap_or_else(|| vec![Lines::from([]); usable.len()]);
        go.fill(&mut found, |i| {
            let (file_offset, address) = usable[i];
            // A binary is read at file offsets, a debug file at addresses.
            if content.holds_code {
                functions.address_of_offset(file_offset)
            } else {
                Some(address)
            }
        });
        Some(found)
    }

    /// The Go function table of `build_id`'s stored file at `path`, read
    /// once while remembered.
    fn go_functions(&mut self, build_id: &str, path: &std::path::Path) -> Option<Arc<GoFunctions>> {
        if let Some(known) = self.go.get(build_id) {
            return known;
        }
        let functions = match std::fs::File::open(path).map(|file| GoFunctions::read(&file)) {
            Ok(Ok(functions)) => functions.map(Arc::new),
            Ok(Err(err)) => {
                tracing::warn!("reading the Go function table of {build_id}: {err:#}");
                None
            }
            Err(err) => {
                tracing::warn!("opening {}: {err}", path.display());
                None
            }
        };
        self.go.insert(build_id.to_owned(), functions.clone());
        functions
    }

    /// The stored file of `build_id` and what it holds; a file that fails
    /// the checks (or is absent) is asked for again next time, since an
    /// upload may bring it.
    fn file(&mut self, build_id: &str) -> Option<(PathBuf, ElfContent)> {
        if let Some(known) = self.files.get(build_id) {
            return Some(known.clone());
        }
        let path = self.store.get(build_id)?;
        let content = std::fs::File::open(&path)
            .ok()
            .and_then(|file| check_elf(&file, build_id).ok());
        let Some(content) = content else {
            tracing::warn!(build_id, "the stored debuginfo fails its checks");
            return None;
        };
        if self.files.len() >= MAX_CHECKED_FILES {
            self.files.clear();
        }
        self.files
            .insert(build_id.to_owned(), (path.clone(), content));
        Some((path, content))
    }

    /// Lines per address (empty: no symbol), or `None` when blazesym
    /// failed on the file.
    fn read(&mut self, path: &std::path::Path, input: Input<&[u64]>) -> Option<Vec<Lines>> {
        if !self.parsed.contains(path) {
            if self.parsed.len() >= MAX_PARSED_FILES {
                // What blazesym parsed stays until dropped: start afresh
                // when a new file would exceed the bound.
                self.reader.rebuild();
                self.parsed.clear();
            }
            self.parsed.insert(path.to_owned());
        }
        let source = Source::Elf(Elf::new(path));
        match self.reader.read(&source, input) {
            Ok(lines) => Some(lines),
            Err(ReadError::Read(err)) => {
                tracing::warn!("naming frames from {}: {err:#}", path.display());
                None
            }
            Err(ReadError::Panicked) => {
                // The reader was rebuilt: nothing is parsed any more.
                tracing::warn!("the symbol reader panicked on {}", path.display());
                self.parsed.clear();
                None
            }
        }
    }
}

/// One frame per function at the address, innermost first; `binary` and
/// `build_id` are filled in by [`replace_frames`].
fn frames_of(lines: &Lines) -> NamedFrames {
    let count = lines.len();
    lines
        .iter()
        .enumerate()
        .map(|(i, line)| {
            Arc::new(Frame {
                file: line.file.to_string(),
                line: line.line,
                inlined: i + 1 < count,
                ..Frame::synthetic(line.function.to_string(), "")
            })
        })
        .collect()
}

/// The distinct unnamed frames of `samples`, by build-id.
fn wanted(samples: &StackSamples) -> Wanted {
    let mut wanted: Wanted = BTreeMap::new();
    let mut seen = HashSet::new();
    for frame in samples.stacks.iter().flat_map(|stack| &stack.frames) {
        if let Some(code) = frame.unnamed_code
            && seen.insert(Arc::as_ptr(frame))
        {
            wanted.entry(frame.build_id.clone()).or_default().push(code);
        }
    }
    for addresses in wanted.values_mut() {
        addresses.sort_unstable();
        addresses.dedup();
    }
    wanted
}

/// `samples` with each unnamed frame that `names` covers replaced by its
/// functions (sharing one `Arc` per stored frame, as storage does).
fn replace_frames(mut samples: StackSamples, names: &Names) -> StackSamples {
    if names.is_empty() {
        return samples;
    }
    let mut replaced: HashMap<*const Frame, Option<Vec<Arc<Frame>>>> = HashMap::new();
    for stack in &mut samples.stacks {
        if !stack
            .frames
            .iter()
            .any(|frame| frame.unnamed_code.is_some())
        {
            continue;
        }
        let mut frames = Vec::with_capacity(stack.frames.len() + 4);
        for frame in stack.frames.drain(..) {
            let replacement = replaced.entry(Arc::as_ptr(&frame)).or_insert_with(|| {
                let code = frame.unnamed_code?;
                let named = names.get(&frame.build_id)?.get(&code.file_offset)?;
                Some(
                    named
                        .iter()
                        .map(|line| {
                            Arc::new(Frame {
                                binary: frame.binary.clone(),
                                build_id: frame.build_id.clone(),
                                ..(**line).clone()
                            })
                        })
                        .collect(),
                )
            });
            match replacement {
                Some(named) => frames.extend(named.iter().cloned()),
                None => frames.push(frame),
            }
        }
        stack.frames = frames;
    }
    samples
}
