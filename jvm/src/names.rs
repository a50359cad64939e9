//! Java method names from a `Method*`: its `ConstMethod` gives the name's
//! index in the class's constant pool, whose holder gives the class; each
//! is a `Symbol` (a length and modified UTF-8 bytes).

use crate::{JvmError, layout::Layout, memory::Memory};

/// Symbol bytes read at most: longer names are cut (with `…`).
const MAX_SYMBOL_BYTES: usize = 512;

/// `package.Class.method` of the method at `method`.
pub fn method_name(memory: &impl Memory, layout: &Layout, method: u64) -> Result<String, JvmError> {
    if method == 0 || !method.is_multiple_of(8) {
        return Err(JvmError::Malformed("not a Method pointer"));
    }
    let const_method = memory.u64_at(method.wrapping_add(layout.method_const))?;
    let pool = memory.u64_at(const_method.wrapping_add(layout.const_method_constants))?;
    let mut index = [0; 2];
    memory.read(
        const_method.wrapping_add(layout.const_method_name_index),
        &mut index,
    )?;
    let name_index = u64::from(u16::from_le_bytes(index));
    let mut length = [0; 4];
    memory.read(pool.wrapping_add(layout.pool_length), &mut length)?;
    let pool_length = u64::from(u32::from_le_bytes(length));
    if name_index == 0 || name_index >= pool_length {
        return Err(JvmError::Malformed(
            "a method name index outside its constant pool",
        ));
    }
    let name = symbol(
        memory,
        layout,
        memory.u64_at(pool.wrapping_add(layout.pool_size + name_index * 8))?,
    )?;
    let holder = memory.u64_at(pool.wrapping_add(layout.pool_holder))?;
    let class = symbol(
        memory,
        layout,
        memory.u64_at(holder.wrapping_add(layout.klass_name))?,
    )?;
    Ok(format!("{}.{name}", class.replace('/', ".")))
}

/// The text of the `Symbol` at `at`.
fn symbol(memory: &impl Memory, layout: &Layout, at: u64) -> Result<String, JvmError> {
    if at == 0 || !at.is_multiple_of(2) {
        return Err(JvmError::Malformed("not a Symbol pointer"));
    }
    let mut length = [0; 2];
    memory.read(at.wrapping_add(layout.symbol_length), &mut length)?;
    let length = usize::from(u16::from_le_bytes(length));
    let mut body = vec![0; length.min(MAX_SYMBOL_BYTES)];
    memory.read(at.wrapping_add(layout.symbol_body), &mut body)?;
    // Modified UTF-8 differs from UTF-8 only for NUL and supplementary
    // characters, which names seldom hold: those show as U+FFFD.
    let mut text = String::from_utf8_lossy(&body).into_owned();
    if length > MAX_SYMBOL_BYTES {
        text.push('…');
    }
    if text.is_empty() || text.chars().any(char::is_control) {
        return Err(JvmError::Malformed("a symbol that is not a name"));
    }
    Ok(text)
}
