//! The Go function table of an ELF file on disk, read once and kept, and
//! names looked up in it by address: what a symbolizer needs for a Go
//! binary stripped of its symbol table and DWARF.
//!
//! Owns finding `.gopclntab` and `.text` in the file's section headers and
//! bounding what is read. Does not own mapping file offsets to addresses
//! (the caller knows the file's segments).

use std::{borrow::Borrow, collections::HashMap, fs::File, hash::Hash, sync::Arc};

use object::{Object as _, ObjectSection as _, ObjectSegment as _, ReadCache};

use crate::{Error, Table};

/// Largest `.gopclntab` read: the biggest Go programs (kubelet, a few
/// hundred MB of binary) have tables of tens of MB.
pub const MAX_TABLE_BYTES: u64 = 512 << 20;

/// Why a file's Go function table could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ElfError {
    /// The file is not ELF, its section headers are damaged, or reading
    /// it failed.
    #[error("reading the ELF file")]
    Elf(#[source] object::Error),
    /// The section is larger than [`MAX_TABLE_BYTES`].
    #[error(".gopclntab of {size} bytes is larger than the limit of {max}")]
    TooLarge {
        /// The section's size.
        size: u64,
        /// [`MAX_TABLE_BYTES`].
        max: u64,
    },
    /// The table itself is malformed.
    #[error("malformed .gopclntab")]
    Table(#[source] Error),
}

/// A Go binary's function table, owned.
#[derive(Debug, Clone)]
pub struct GoFunctions {
    bytes: Vec<u8>,
    text_start: u64,
    /// The file's loadable segments: `(file offset, address, file size)`.
    segments: Vec<(u64, u64, u64)>,
}

/// What the table says of one address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Named<'a> {
    /// The function holding the address.
    pub function: &'a str,
    /// Its file and line, unless the address is in code inlined into it.
    pub file_line: Option<(&'a str, u32)>,
}

impl GoFunctions {
    /// Reads the table of `file`; `None` when the file has no
    /// `.gopclntab` (not a Go binary) nor `.data.rel.ro.gopclntab`.
    pub fn read(file: &File) -> Result<Option<Self>, ElfError> {
        let cache = ReadCache::new(file);
        let elf = object::File::parse(&cache).map_err(ElfError::Elf)?;
        let Some(section) = crate::SECTION_NAMES
            .iter()
            .find_map(|name| elf.section_by_name(name))
        else {
            return Ok(None);
        };
        if section.size() > MAX_TABLE_BYTES {
            return Err(ElfError::TooLarge {
                size: section.size(),
                max: MAX_TABLE_BYTES,
            });
        }
        let bytes = section.data().map_err(ElfError::Elf)?.to_vec();
        let text_start = elf
            .section_by_name(".text")
            .map_or(0, |text| text.address());
        let segments = elf
            .segments()
            .map(|segment| {
                let (offset, size) = segment.file_range();
                (offset, segment.address(), size)
            })
            .collect();
        let functions = Self {
            bytes,
            text_start,
            segments,
        };
        functions.table().map_err(ElfError::Table)?;
        Ok(Some(functions))
    }

    /// The address file offset `offset` is loaded at, by the file's
    /// loadable segments.
    pub fn address_of_offset(&self, offset: u64) -> Option<u64> {
        self.segments.iter().find_map(|&(start, address, size)| {
            let delta = offset.checked_sub(start)?;
            (delta < size).then(|| address.wrapping_add(delta))
        })
    }

    /// Bytes held.
    pub fn heap_bytes(&self) -> usize {
        self.bytes.capacity()
    }

    /// The parsed table (the function index is checked again: linear in
    /// the number of functions, so parse once per batch of lookups).
    pub fn table(&self) -> Result<Table<'_>, Error> {
        Table::parse(&self.bytes, self.text_start)
    }
}

/// The function at `address` (an ELF virtual address), its file and line.
/// `None` where no function covers it or its record is damaged.
pub fn lookup<'a>(table: &Table<'a>, address: u64) -> Option<Named<'a>> {
    let func = table.func_at(address).ok()??;
    Some(Named {
        function: func.name,
        file_line: table.file_line(&func, address).ok().flatten(),
    })
}

/// Files' Go function tables (or that a file has none) by a key of the
/// caller's, bounded by entries and by the tables' bytes: past either, all
/// are dropped and read again as needed.
#[derive(Debug)]
pub struct GoTableCache<K> {
    tables: HashMap<K, Option<Arc<GoFunctions>>>,
    bytes: usize,
    max_entries: usize,
    max_bytes: usize,
}

impl<K: Eq + Hash> GoTableCache<K> {
    pub fn new(max_entries: usize, max_bytes: usize) -> Self {
        Self {
            tables: HashMap::new(),
            bytes: 0,
            max_entries,
            max_bytes,
        }
    }

    /// What is known of `key`: `None` when it was never read.
    pub fn get<Q>(&self, key: &Q) -> Option<Option<Arc<GoFunctions>>>
    where
        K: Borrow<Q>,
        Q: Eq + Hash + ?Sized,
    {
        self.tables.get(key).cloned()
    }

    /// Remembers what reading `key` gave.
    pub fn insert(&mut self, key: K, functions: Option<Arc<GoFunctions>>) {
        let adding = functions.as_ref().map_or(0, |f| f.heap_bytes());
        if self.tables.len() >= self.max_entries || self.bytes + adding > self.max_bytes {
            self.tables.clear();
            self.bytes = 0;
        }
        if let Some(old) = self.tables.insert(key, functions).flatten() {
            self.bytes -= old.heap_bytes();
        }
        self.bytes += adding;
    }

    /// Bytes of the tables held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Files known (with a table or without).
    pub fn len(&self) -> usize {
        self.tables.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tables.is_empty()
    }

    /// The bounds: entries and bytes.
    pub fn limits(&self) -> (usize, usize) {
        (self.max_entries, self.max_bytes)
    }
}
