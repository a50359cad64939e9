//! HotSpot's description of itself: `libjvm.so` exports `gHotSpotVMStructs`
//! (every field the serviceability agent reads: its type, name, offset, or
//! address when static), `gHotSpotVMTypes` (type sizes) and the integer
//! constants, each an array of entries whose layout the library exports
//! too (`gHotSpotVMStructEntryFieldNameOffset`, ...). Reading these, not
//! offsets compiled in per release, is what lets one agent read JDK 8's
//! successors as they move fields around.

use std::{collections::HashMap, fs::File, path::Path};

use object::{
    Endianness, ReadCache, elf,
    read::elf::{FileHeader as _, SectionHeader as _, Sym as _},
};

use crate::{JvmError, memory::Memory};

/// The exported symbols the tables are found through.
const SYMBOLS: [&str; 20] = [
    "gHotSpotVMStructs",
    "gHotSpotVMStructEntryArrayStride",
    "gHotSpotVMStructEntryTypeNameOffset",
    "gHotSpotVMStructEntryFieldNameOffset",
    "gHotSpotVMStructEntryTypeStringOffset",
    "gHotSpotVMStructEntryIsStaticOffset",
    "gHotSpotVMStructEntryOffsetOffset",
    "gHotSpotVMStructEntryAddressOffset",
    "gHotSpotVMTypes",
    "gHotSpotVMTypeEntryArrayStride",
    "gHotSpotVMTypeEntryTypeNameOffset",
    "gHotSpotVMTypeEntrySizeOffset",
    "gHotSpotVMIntConstants",
    "gHotSpotVMIntConstantEntryArrayStride",
    "gHotSpotVMIntConstantEntryNameOffset",
    "gHotSpotVMIntConstantEntryValueOffset",
    "gHotSpotVMLongConstants",
    "gHotSpotVMLongConstantEntryArrayStride",
    "gHotSpotVMLongConstantEntryNameOffset",
    "gHotSpotVMLongConstantEntryValueOffset",
];

/// Entries read at most per table: JDK 17 has about 2,600 fields; a
/// table without its terminating entry is refused rather than read on.
const MAX_ENTRIES: usize = 16_384;

/// The bytes of `.dynsym` and `.dynstr` read at most.
const MAX_DYNAMIC_SYMBOL_BYTES: u64 = 4 << 20;

/// Where `libjvm.so`'s tables are in its file (virtual addresses: add the
/// library's load bias for a process).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LibJvm {
    symbols: [u64; 20],
}

impl LibJvm {
    /// Finds the tables' symbols in `path`'s dynamic symbols; `Ok(None)`
    /// when the file is not a HotSpot library (some symbol is missing).
    pub fn read(path: &Path) -> Result<Option<Self>, JvmError> {
        let file = File::open(path).map_err(JvmError::Open)?;
        let cache = ReadCache::new(&file);
        let found = dynamic_symbols(&cache, &SYMBOLS).map_err(JvmError::Elf)?;
        let mut symbols = [0; 20];
        for (slot, value) in symbols.iter_mut().zip(found) {
            match value {
                Some(value) => *slot = value,
                None => return Ok(None),
            }
        }
        Ok(Some(Self { symbols }))
    }
}

#[cfg(test)]
impl LibJvm {
    /// The tables' symbols at these addresses.
    pub(crate) fn at(symbols: [u64; 20]) -> Self {
        Self { symbols }
    }
}

fn dynamic_symbols<const N: usize>(
    data: &ReadCache<&File>,
    names: &[&str; N],
) -> Result<[Option<u64>; N], object::Error> {
    let header = elf::FileHeader64::<Endianness>::parse(data)?;
    let endian = header.endian()?;
    let sections = header.sections(endian, data)?;
    let mut found = [None; N];
    for (index, section) in sections.iter().enumerate() {
        if section.sh_type(endian) != elf::SHT_DYNSYM
            || section.sh_size(endian) > MAX_DYNAMIC_SYMBOL_BYTES
        {
            continue;
        }
        if sections.section(section.link(endian))?.sh_size(endian) > MAX_DYNAMIC_SYMBOL_BYTES {
            continue;
        }
        let table = object::read::elf::SymbolTable::parse(
            endian,
            data,
            &sections,
            object::SectionIndex(index),
            section,
        )?;
        for symbol in table.symbols() {
            let Ok(name) = symbol.name(endian, table.strings()) else {
                continue;
            };
            if let Some(at) = names.iter().position(|n| n.as_bytes() == name) {
                found[at] = Some(symbol.st_value(endian));
            }
        }
    }
    Ok(found)
}

/// One field of `gHotSpotVMStructs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    /// An instance field at this offset in its type.
    Offset(u64),
    /// A static field at this address in the process.
    Static(u64),
}

/// The tables as one process holds them.
#[derive(Debug, Default, Clone)]
pub struct VmStructs {
    /// (type, field) to the field, and the field's type as written in C++.
    fields: HashMap<(String, String), (Field, String)>,
    /// Type sizes in bytes.
    sizes: HashMap<String, u64>,
    constants: HashMap<String, i64>,
}

impl VmStructs {
    /// Reads the tables of the process `memory` reads, whose `libjvm.so`
    /// is loaded at `bias`.
    pub fn read(memory: &impl Memory, lib: &LibJvm, bias: u64) -> Result<Self, JvmError> {
        let at = |i: usize| lib.symbols[i].wrapping_add(bias);
        let word = |i: usize| memory.u64_at(at(i));
        let mut tables = Self::default();

        let (stride, type_name, field_name, type_string, is_static, offset, address) = (
            word(1)?,
            word(2)?,
            word(3)?,
            word(4)?,
            word(5)?,
            word(6)?,
            word(7)?,
        );
        let need = [
            type_name.saturating_add(8),
            field_name.saturating_add(8),
            type_string.saturating_add(8),
            is_static.saturating_add(4),
            offset.saturating_add(8),
            address.saturating_add(8),
        ];
        let entry_len = checked_entry(stride, &need)?;
        let base = word(0)?;
        let mut entry = vec![0u8; entry_len];
        for i in 0..MAX_ENTRIES {
            memory.read(base.wrapping_add(i as u64 * stride), &mut entry)?;
            let type_ptr = le_u64(&entry, type_name);
            if type_ptr == 0 {
                return tables.with_types(memory, &word);
            }
            let field_ptr = le_u64(&entry, field_name);
            if field_ptr == 0 {
                continue;
            }
            let ty = memory.c_string(type_ptr, 256)?;
            let name = memory.c_string(field_ptr, 256)?;
            let type_string_ptr = le_u64(&entry, type_string);
            let declared = if type_string_ptr == 0 {
                String::new()
            } else {
                memory.c_string(type_string_ptr, 256)?
            };
            let field = if le_u32(&entry, is_static) != 0 {
                Field::Static(le_u64(&entry, address))
            } else {
                Field::Offset(le_u64(&entry, offset))
            };
            tables.fields.insert((ty, name), (field, declared));
        }
        Err(JvmError::Malformed("gHotSpotVMStructs has no end"))
    }

    fn with_types(
        mut self,
        memory: &impl Memory,
        word: &impl Fn(usize) -> Result<u64, JvmError>,
    ) -> Result<Self, JvmError> {
        let (base, stride, name, size) = (word(8)?, word(9)?, word(10)?, word(11)?);
        let mut entry =
            vec![0u8; checked_entry(stride, &[name.saturating_add(8), size.saturating_add(8)])?];
        for i in 0..MAX_ENTRIES {
            memory.read(base.wrapping_add(i as u64 * stride), &mut entry)?;
            let name_ptr = le_u64(&entry, name);
            if name_ptr == 0 {
                break;
            }
            self.sizes
                .insert(memory.c_string(name_ptr, 256)?, le_u64(&entry, size));
        }
        for (table, long) in [(12, false), (16, true)] {
            let (base, stride, name, value) = (
                word(table)?,
                word(table + 1)?,
                word(table + 2)?,
                word(table + 3)?,
            );
            let mut entry =
                vec![
                    0u8;
                    checked_entry(stride, &[name.saturating_add(8), value.saturating_add(8)])?
                ];
            for i in 0..MAX_ENTRIES {
                memory.read(base.wrapping_add(i as u64 * stride), &mut entry)?;
                let name_ptr = le_u64(&entry, name);
                if name_ptr == 0 {
                    break;
                }
                let value = if long {
                    le_u64(&entry, value) as i64
                } else {
                    i64::from(le_u32(&entry, value) as i32)
                };
                self.constants
                    .insert(memory.c_string(name_ptr, 256)?, value);
            }
        }
        Ok(self)
    }

    /// An instance field's offset.
    pub fn offset(&self, ty: &str, field: &str) -> Result<u64, JvmError> {
        match self.get(ty, field) {
            Some((Field::Offset(offset), _)) => Ok(offset),
            _ => Err(JvmError::Missing(format!("{ty}::{field}"))),
        }
    }

    /// A static field's address.
    pub fn address(&self, ty: &str, field: &str) -> Result<u64, JvmError> {
        match self.get(ty, field) {
            Some((Field::Static(address), _)) => Ok(address),
            _ => Err(JvmError::Missing(format!("{ty}::{field}"))),
        }
    }

    /// A field and its C++ type.
    pub fn get(&self, ty: &str, field: &str) -> Option<(Field, &str)> {
        self.fields
            .get(&(ty.to_owned(), field.to_owned()))
            .map(|(field, declared)| (*field, declared.as_str()))
    }

    /// A type's size in bytes.
    pub fn size(&self, ty: &str) -> Result<u64, JvmError> {
        self.sizes
            .get(ty)
            .copied()
            .ok_or_else(|| JvmError::Missing(format!("sizeof({ty})")))
    }

    pub fn constant(&self, name: &str) -> Option<i64> {
        self.constants.get(name).copied()
    }
}

/// The bytes of an entry to read: its stride, if every field read
/// (`need`: the end of each) lies within it and it is of a sane size.
fn checked_entry(stride: u64, need: &[u64]) -> Result<usize, JvmError> {
    if stride == 0 || stride > 256 || need.iter().any(|&end| end > stride) {
        return Err(JvmError::Malformed("a table entry's layout"));
    }
    Ok(stride as usize)
}

fn le_u64(bytes: &[u8], at: u64) -> u64 {
    let at = at as usize;
    u64::from_le_bytes(
        bytes[at..at + 8]
            .try_into()
            .expect("checked by checked_entry"),
    )
}

fn le_u32(bytes: &[u8], at: u64) -> u32 {
    let at = at as usize;
    u32::from_le_bytes(
        bytes[at..at + 4]
            .try_into()
            .expect("checked by checked_entry"),
    )
}
