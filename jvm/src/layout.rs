//! The offsets the readers use, taken from one process's [`VmStructs`]:
//! HotSpot moves fields between releases (JDK 17's `CodeBlob` holds code
//! pointers, JDK 25's holds offsets and a kind), so each is looked up by
//! name and the few shapes are told apart by which fields exist.

use crate::{
    JvmError,
    scopes::ScopesLayout,
    vmstructs::{Field, VmStructs},
};

/// Where a blob's code is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CodeRange {
    /// `_code_begin` and `_code_end`, absolute (JDK 9-22).
    Pointers { begin: u64, end: u64 },
    /// `_code_offset` and `_data_offset` from the blob's start (JDK 23+).
    Offsets { code: u64, data: u64 },
}

/// `AbstractInterpreter::_code` (a `StubQueue*`'s address) and the fields
/// that list the interpreter's codelets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InterpreterLayout {
    pub code: u64,
    pub stub_buffer: u64,
    pub queue_begin: u64,
    pub queue_end: u64,
    pub codelet_size: u64,
    pub codelet_description: u64,
    pub codelet_bytecode: u64,
}

/// Where an nmethod's verified entry is said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VerifiedEntry {
    /// `_verified_entry_point`, an address (JDK 9-22).
    Pointer(u64),
    /// `_verified_entry_offset`, 16 bits from the code's start (JDK 23+).
    Offset(u64),
}

/// See the module documentation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// `CodeCache::_heaps`: the address of the `GrowableArray<CodeHeap*>*`.
    pub heaps: u64,
    pub array_len: u64,
    pub array_data: u64,
    pub heap_memory: u64,
    pub heap_segmap: u64,
    pub heap_log2_segment_size: u64,
    pub space_low: u64,
    pub space_high: u64,
    /// `sizeof(HeapBlock)`: a blob starts this far past its block.
    pub heap_block_size: u64,
    /// `HeapBlock::Header::_used`, where the build exports it.
    pub block_used: Option<u64>,
    pub blob_name: u64,
    pub blob_size: u64,
    /// `_frame_complete_offset` and whether it is 16 bits wide (JDK 23+).
    pub blob_frame_complete: (u64, bool),
    pub blob_frame_size: u64,
    pub blob_code: CodeRange,
    /// `CodeBlob::_kind` (one byte) and its value for nmethods (JDK 23+).
    pub blob_kind: Option<(u64, u8)>,
    /// Bytes read at a blob's start: its header, an nmethod's whole.
    pub blob_header_bytes: u64,
    pub nmethod_method: u64,
    pub nmethod_compile_id: u64,
    /// `nmethod::_stub_offset`, from the blob's start.
    pub nmethod_stub_offset: Option<u64>,
    /// Where an nmethod's verified entry is (past its inline cache check).
    pub nmethod_verified_entry: Option<VerifiedEntry>,
    /// Where the template interpreter's codelets are listed.
    pub interpreter: Option<InterpreterLayout>,
    /// `StubRoutines::_call_stub_return_address`: the address of the
    /// return address Java's first frame returns to.
    pub call_stub_return: Option<u64>,
    /// Where an nmethod's inlining is recorded, in the builds whose layout
    /// and encoding the scopes reader knows (JDK 9-19).
    pub scopes: Option<ScopesLayout>,
    pub method_const: u64,
    pub const_method_constants: u64,
    pub const_method_name_index: u64,
    pub pool_holder: u64,
    /// `sizeof(ConstantPool)`: its entries (a word each) follow it.
    pub pool_size: u64,
    pub pool_length: u64,
    pub klass_name: u64,
    pub symbol_length: u64,
    pub symbol_body: u64,
}

impl Layout {
    /// `major`: the JVM's major version (`Abstract_VM_Version::_vm_major_version`).
    pub fn new(vm: &VmStructs, major: u32) -> Result<Self, JvmError> {
        let blob_code = match (
            vm.get("CodeBlob", "_code_begin"),
            vm.get("CodeBlob", "_code_offset"),
        ) {
            (Some((Field::Offset(begin), _)), _) => CodeRange::Pointers {
                begin,
                end: vm.offset("CodeBlob", "_code_end")?,
            },
            (_, Some((Field::Offset(code), _))) => CodeRange::Offsets {
                code,
                data: vm.offset("CodeBlob", "_data_offset")?,
            },
            _ => return Err(JvmError::Missing("CodeBlob's code range".into())),
        };
        let blob_kind = match vm.get("CodeBlob", "_kind") {
            Some((Field::Offset(at), _)) => {
                let nmethod = vm
                    .constant("CodeBlobKind::Nmethod")
                    .and_then(|kind| u8::try_from(kind).ok())
                    .ok_or_else(|| JvmError::Missing("CodeBlobKind::Nmethod".into()))?;
                Some((at, nmethod))
            }
            _ => None,
        };
        let frame_complete = match vm.get("CodeBlob", "_frame_complete_offset") {
            Some((Field::Offset(at), declared)) => (at, declared == "int16_t"),
            _ => return Err(JvmError::Missing("CodeBlob::_frame_complete_offset".into())),
        };
        // JDK 17 keeps the method in CompiledMethod, nmethod's base.
        let nmethod_method = vm
            .offset("nmethod", "_method")
            .or_else(|_| vm.offset("CompiledMethod", "_method"))?;
        let layout = Self {
            heaps: vm.address("CodeCache", "_heaps")?,
            array_len: vm
                .offset("GrowableArrayBase", "_len")
                .or_else(|_| vm.offset("GenericGrowableArray", "_len"))?,
            array_data: vm.offset("GrowableArray<int>", "_data")?,
            heap_memory: vm.offset("CodeHeap", "_memory")?,
            heap_segmap: vm.offset("CodeHeap", "_segmap")?,
            heap_log2_segment_size: vm.offset("CodeHeap", "_log2_segment_size")?,
            space_low: vm.offset("VirtualSpace", "_low")?,
            space_high: vm.offset("VirtualSpace", "_high")?,
            heap_block_size: vm.size("HeapBlock")?,
            block_used: vm.offset("HeapBlock::Header", "_used").ok(),
            blob_name: vm.offset("CodeBlob", "_name")?,
            blob_size: vm.offset("CodeBlob", "_size")?,
            blob_frame_complete: frame_complete,
            blob_frame_size: vm.offset("CodeBlob", "_frame_size")?,
            blob_code,
            blob_kind,
            blob_header_bytes: vm.size("nmethod")?,
            nmethod_method,
            nmethod_compile_id: vm.offset("nmethod", "_compile_id")?,
            nmethod_stub_offset: vm.offset("nmethod", "_stub_offset").ok(),
            nmethod_verified_entry: vm
                .offset("nmethod", "_verified_entry_point")
                .map(VerifiedEntry::Pointer)
                .or_else(|_| {
                    vm.offset("nmethod", "_verified_entry_offset")
                        .map(VerifiedEntry::Offset)
                })
                .ok(),
            call_stub_return: vm.address("StubRoutines", "_call_stub_return_address").ok(),
            interpreter: interpreter_layout(vm),
            // JDK 20 changed the scope records' encoding (UNSIGNED5) and JDK
            // 23 moved them: the reader knows those before.
            scopes: scopes_layout(vm).filter(|_| major <= 19),
            method_const: vm.offset("Method", "_constMethod")?,
            const_method_constants: vm.offset("ConstMethod", "_constants")?,
            const_method_name_index: vm.offset("ConstMethod", "_name_index")?,
            pool_holder: vm.offset("ConstantPool", "_pool_holder")?,
            pool_size: vm.size("ConstantPool")?,
            pool_length: vm.offset("ConstantPool", "_length")?,
            klass_name: vm.offset("Klass", "_name")?,
            symbol_length: vm.offset("Symbol", "_length")?,
            symbol_body: vm.offset("Symbol", "_body")?,
        };
        layout.check()?;
        Ok(layout)
    }

    /// Refuses offsets that would make the readers read past the bytes
    /// they read (a damaged table, or a build laid out unlike any seen).
    fn check(&self) -> Result<(), JvmError> {
        let header = self.blob_header_bytes;
        let code_end = match self.blob_code {
            CodeRange::Pointers { begin, end } => begin.max(end).saturating_add(8),
            CodeRange::Offsets { code, data } => code.max(data).saturating_add(4),
        };
        let ends = [
            self.blob_name.saturating_add(8),
            self.blob_size.saturating_add(4),
            self.blob_frame_complete.0.saturating_add(4),
            self.blob_frame_size.saturating_add(4),
            code_end,
            self.nmethod_method.saturating_add(8),
            self.nmethod_compile_id.saturating_add(4),
            self.blob_kind.map_or(0, |(at, _)| at.saturating_add(1)),
        ];
        let scopes_ends = self.scopes.map_or([0; 4], |scopes| {
            [
                scopes.pcs_offset.saturating_add(4),
                scopes.pcs_end_offset.saturating_add(4),
                scopes.metadata_offset.saturating_add(4),
                scopes.data_begin.saturating_add(8),
            ]
        });
        let stubs_end = self
            .nmethod_stub_offset
            .map_or(0, |at| at.saturating_add(4));
        let verified_end = match self.nmethod_verified_entry {
            Some(VerifiedEntry::Pointer(at)) => at.saturating_add(8),
            Some(VerifiedEntry::Offset(at)) => at.saturating_add(2),
            None => 0,
        };
        if header > 1024
            || ends
                .iter()
                .chain(&scopes_ends)
                .chain([&stubs_end, &verified_end])
                .any(|&end| end > header)
        {
            return Err(JvmError::Malformed(
                "code blob offsets outside sizeof(nmethod)",
            ));
        }
        let small = [
            self.method_const,
            self.const_method_constants,
            self.const_method_name_index,
            self.pool_holder,
            self.pool_length,
            self.pool_size,
            self.klass_name,
            self.symbol_length,
            self.symbol_body,
            self.heap_memory,
            self.heap_segmap,
            self.heap_log2_segment_size,
            self.heap_block_size,
        ];
        if small.iter().any(|&offset| offset > 1024) || self.heap_block_size == 0 {
            return Err(JvmError::Malformed("metadata offsets out of range"));
        }
        if let Some(scopes) = self.scopes
            && (!(8..=64).contains(&scopes.pc_desc_size)
                || scopes.pc_desc_pc_offset.saturating_add(4) > scopes.pc_desc_size
                || scopes.pc_desc_scope_offset.saturating_add(4) > scopes.pc_desc_size)
        {
            return Err(JvmError::Malformed("PcDesc offsets outside sizeof(PcDesc)"));
        }
        Ok(())
    }
}

/// The interpreter's codelets' layout, when every field of it is exported.
fn interpreter_layout(vm: &VmStructs) -> Option<InterpreterLayout> {
    Some(InterpreterLayout {
        code: vm.address("AbstractInterpreter", "_code").ok()?,
        stub_buffer: vm.offset("StubQueue", "_stub_buffer").ok()?,
        queue_begin: vm.offset("StubQueue", "_queue_begin").ok()?,
        queue_end: vm.offset("StubQueue", "_queue_end").ok()?,
        codelet_size: vm.offset("InterpreterCodelet", "_size").ok()?,
        codelet_description: vm.offset("InterpreterCodelet", "_description").ok()?,
        codelet_bytecode: vm.offset("InterpreterCodelet", "_bytecode").ok()?,
    })
}

/// The scopes' layout, when every field of it is exported.
fn scopes_layout(vm: &VmStructs) -> Option<ScopesLayout> {
    Some(ScopesLayout {
        pcs_offset: vm.offset("nmethod", "_scopes_pcs_offset").ok()?,
        pcs_end_offset: vm.offset("nmethod", "_dependencies_offset").ok()?,
        metadata_offset: vm.offset("nmethod", "_metadata_offset").ok()?,
        data_begin: vm.offset("CompiledMethod", "_scopes_data_begin").ok()?,
        pc_desc_size: vm.size("PcDesc").ok()?,
        pc_desc_pc_offset: vm.offset("PcDesc", "_pc_offset").ok()?,
        pc_desc_scope_offset: vm.offset("PcDesc", "_scope_decode_offset").ok()?,
    })
}
