//! Where the running kernel keeps a task's thread group leader, start time,
//! name and user thread pointer in `struct task_struct`, and where its process's
//! stack started in `struct mm_struct`, read from the kernel's BTF. The
//! sampler passes the offsets to the BPF program, which then stamps every
//! sample with its process's start time (with the pid, the process's
//! identity) and bounds the first deep copies of a thread by its thread
//! pointer, or of a main thread by its process's stack start.
//!
//! Owns only finding the offsets; the BPF program does the reads. The
//! scan is our own rather than a BTF library's: it needs a few member
//! offsets of two structs, and a library that builds the whole type graph of
//! vmlinux's BTF (5 MB, 100k+ types) cost the agent 55 MB of peak heap and
//! half a second at start-up. This walks the type section in place, once
//! per struct.

use std::path::Path;

/// The kernel's own BTF.
pub const VMLINUX_BTF: &str = "/sys/kernel/btf/vmlinux";

/// Byte offsets in `struct task_struct`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TaskLayout {
    /// `group_leader`: a pointer to the thread group leader's task.
    pub group_leader: u32,
    /// `start_time`: when the task started, monotonic nanoseconds.
    pub start_time: u32,
    /// `thread.fsbase`: the user thread pointer (x86-64); `None` where the
    /// BTF has no such member.
    pub fsbase: Option<u32>,
    /// Where the main thread's stack started; `None` where the BTF lacks
    /// either member.
    pub stack_start: Option<StackStartLayout>,
    /// `pid`: the thread id (off-CPU samples name the thread a switch runs
    /// next by it); `None` where the BTF lacks it.
    pub pid: Option<u32>,
    /// `comm`: the thread's name, which samples carry; `None` where the
    /// BTF lacks it (the program then asks a helper of its own).
    pub comm: Option<u32>,
}

/// Byte offsets of a process's stack start: `task_struct.mm`, a pointer to
/// the process's `struct mm_struct`, and there `start_stack` (the address
/// of `argc` at exec, above the main thread's outermost frame).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StackStartLayout {
    pub mm: u32,
    pub start_stack: u32,
}

/// Why the layout could not be found.
#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    #[error("reading {path}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("not BTF: {0}")]
    NotBtf(&'static str),
    #[error("BTF type {id} is cut off or of unknown kind {kind}")]
    BadType { id: u32, kind: u32 },
    #[error("the kernel's BTF has no struct task_struct")]
    NoTaskStruct,
    #[error("task_struct.{0} is missing or not byte-aligned")]
    Member(&'static str),
}

const BTF_MAGIC: u16 = 0xeb9f;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;

impl TaskLayout {
    /// The layout of the running kernel, from [`VMLINUX_BTF`].
    pub fn of_running_kernel() -> Result<Self, LayoutError> {
        Self::from_btf_file(Path::new(VMLINUX_BTF))
    }

    pub fn from_btf_file(path: &Path) -> Result<Self, LayoutError> {
        let bytes = std::fs::read(path).map_err(|source| LayoutError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_btf(&bytes)
    }

    /// Finds the layout in raw BTF (as `/sys/kernel/btf/vmlinux` holds it).
    pub fn from_btf(btf: &[u8]) -> Result<Self, LayoutError> {
        let btf = Btf::parse(btf)?;
        let members = btf
            .struct_members("task_struct")?
            .ok_or(LayoutError::NoTaskStruct)?;
        let offset = |wanted: &'static str| {
            btf.byte_offset(&members, wanted)
                .ok_or(LayoutError::Member(wanted))
        };
        // The thread pointer and the stack start are optional: without
        // them, only the first deep copies of threads are lost, so a flaw
        // past task_struct is not the other offsets' error.
        let nested = |outer: &str, inner_struct: &str, inner: &str| {
            let outer = btf.byte_offset(&members, outer)?;
            let members = btf.struct_members(inner_struct).ok().flatten()?;
            Some((outer, btf.byte_offset(&members, inner)?))
        };
        let fsbase = nested("thread", "thread_struct", "fsbase")
            .and_then(|(thread, fsbase)| thread.checked_add(fsbase));
        let stack_start = nested("mm", "mm_struct", "start_stack")
            .map(|(mm, start_stack)| StackStartLayout { mm, start_stack });
        Ok(Self {
            group_leader: offset("group_leader")?,
            start_time: offset("start_time")?,
            fsbase,
            stack_start,
            pid: btf.byte_offset(&members, "pid"),
            comm: btf.byte_offset(&members, "comm"),
        })
    }
}

/// A struct's or union's members.
type Members<'a> = Vec<Member<'a>>;

struct Member<'a> {
    /// Empty for an anonymous struct or union.
    name: &'a [u8],
    type_id: u32,
    bit_offset: u32,
}

/// How deep anonymous structs and unions are searched for a member
/// (`mm_struct` keeps its members one level down); it also bounds the
/// search in BTF whose anonymous members form a cycle.
const MAX_ANONYMOUS_DEPTH: u32 = 3;

struct Btf<'a> {
    types: &'a [u8],
    strings: &'a [u8],
}

fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(*bytes.get(at..)?.first_chunk::<4>()?))
}

impl<'a> Btf<'a> {
    fn parse(bytes: &'a [u8]) -> Result<Self, LayoutError> {
        let magic = bytes.get(..2).map(|m| u16::from_le_bytes([m[0], m[1]]));
        if magic != Some(BTF_MAGIC) {
            return Err(LayoutError::NotBtf("no BTF magic (or not little-endian)"));
        }
        let header = |at| u32_at(bytes, at).ok_or(LayoutError::NotBtf("the header is cut off"));
        let header_len = header(4)? as usize;
        let section = |offset: u32, len: u32| {
            let start = header_len.checked_add(offset as usize)?;
            bytes.get(start..start.checked_add(len as usize)?)
        };
        let types = section(header(8)?, header(12)?).ok_or(LayoutError::NotBtf(
            "the type section lies outside the file",
        ))?;
        let strings = section(header(16)?, header(20)?).ok_or(LayoutError::NotBtf(
            "the string section lies outside the file",
        ))?;
        Ok(Self { types, strings })
    }

    fn string(&self, offset: u32) -> &'a [u8] {
        let rest = self.strings.get(offset as usize..).unwrap_or_default();
        rest.split(|&b| b == 0).next().unwrap_or_default()
    }

    /// The byte offset of member `wanted` of a struct with `members`,
    /// found directly or inside its anonymous structs and unions, if it is
    /// there and byte-aligned.
    fn byte_offset(&self, members: &Members<'_>, wanted: &str) -> Option<u32> {
        let bits = self.bit_offset(members, wanted.as_bytes(), 0)?;
        bits.is_multiple_of(8).then_some(bits / 8)
    }

    fn bit_offset(&self, members: &Members<'_>, wanted: &[u8], depth: u32) -> Option<u32> {
        if let Some(member) = members.iter().find(|m| m.name == wanted) {
            return Some(member.bit_offset);
        }
        if depth >= MAX_ANONYMOUS_DEPTH {
            return None;
        }
        members
            .iter()
            .filter(|m| m.name.is_empty())
            .find_map(|anonymous| {
                let inner = self.members_of_type(anonymous.type_id).ok().flatten()?;
                let bits = self.bit_offset(&inner, wanted, depth + 1)?;
                anonymous.bit_offset.checked_add(bits)
            })
    }

    /// The members of the first struct called `name` that has any.
    fn struct_members(&self, name: &str) -> Result<Option<Members<'a>>, LayoutError> {
        self.find_members(|_, kind, type_name, vlen| {
            kind == KIND_STRUCT && vlen > 0 && type_name == name.as_bytes()
        })
    }

    /// The members of type `id`, if it is a struct or a union.
    fn members_of_type(&self, id: u32) -> Result<Option<Members<'a>>, LayoutError> {
        self.find_members(|type_id, kind, _, _| {
            type_id == id && (kind == KIND_STRUCT || kind == KIND_UNION)
        })
    }

    /// The members of the first struct or union type for which `wanted`
    /// (given its id, kind, name and member count) holds.
    fn find_members(
        &self,
        wanted: impl Fn(u32, u32, &[u8], usize) -> bool,
    ) -> Result<Option<Members<'a>>, LayoutError> {
        let mut at = 0usize;
        let mut id = 1u32;
        while at < self.types.len() {
            let field = |i: usize| u32_at(self.types, at + 4 * i);
            let (Some(name_off), Some(info)) = (field(0), field(1)) else {
                return Err(LayoutError::BadType { id, kind: 0 });
            };
            let kind = (info >> 24) & 0x1f;
            let vlen = (info & 0xffff) as usize;
            let extra = match kind {
                2 | 7 | 8 | 9 | 10 | 11 | 12 | 16 | 18 => 0,
                1 | 14 | 17 => 4,
                3 => 12,
                4 | 5 | 15 | 19 => 12 * vlen,
                6 | 13 => 8 * vlen,
                _ => return Err(LayoutError::BadType { id, kind }),
            };
            let body = at + 12;
            let end = body + extra;
            if end > self.types.len() {
                return Err(LayoutError::BadType { id, kind });
            }
            if (kind == KIND_STRUCT || kind == KIND_UNION)
                && wanted(id, kind, self.string(name_off), vlen)
            {
                // With kind_flag, the top 8 bits of a member's offset are
                // its bitfield size.
                let bitfields = info >> 31 == 1;
                let members = (0..vlen)
                    .map(|i| {
                        let member = body + 12 * i;
                        let word = |j: usize| u32_at(self.types, member + 4 * j).unwrap_or(0);
                        let offset = word(2);
                        Member {
                            name: self.string(word(0)),
                            type_id: word(1),
                            bit_offset: if bitfields {
                                offset & 0x00ff_ffff
                            } else {
                                offset
                            },
                        }
                    })
                    .collect();
                return Ok(Some(members));
            }
            at = end;
            id += 1;
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_running_kernels_task_layout() {
        let layout = TaskLayout::of_running_kernel().expect("this kernel has BTF");
        // The members sit well inside task_struct, 8-aligned, and apart;
        // the thread pointer in `thread`, at its end.
        assert!(layout.group_leader > 0 && layout.group_leader.is_multiple_of(8));
        assert!(layout.start_time > 0 && layout.start_time.is_multiple_of(8));
        assert_ne!(layout.group_leader, layout.start_time);
        let pid = layout.pid.expect("task_struct.pid");
        assert!(pid > 0 && pid.is_multiple_of(4));
        let comm = layout.comm.expect("task_struct.comm");
        assert!(comm > 0 && ![pid, layout.start_time, layout.group_leader].contains(&comm));
        #[cfg(target_arch = "x86_64")]
        {
            let fsbase = layout.fsbase.expect("x86-64 kernels have thread.fsbase");
            assert!(fsbase.is_multiple_of(8));
            assert!(fsbase > layout.start_time.max(layout.group_leader));
        }
        // `start_stack` sits in an anonymous struct of mm_struct in the
        // kernels this runs on.
        let stack_start = layout
            .stack_start
            .expect("task_struct.mm and mm_struct.start_stack");
        assert!(stack_start.mm > 0 && stack_start.mm.is_multiple_of(8));
        assert!(stack_start.start_stack > 0 && stack_start.start_stack.is_multiple_of(8));
    }

    /// BTF with an int, a pointer, `struct task_struct { int pid; ptr
    /// group_leader; u64 start_time; struct thread_struct thread; ptr mm;
    /// int comm; }` at bit offsets 0, 64, `start_time_bits`, 2048, 1536 and
    /// 1600, `struct thread_struct { int sp; int fsbase; }` at 0 and 64,
    /// and `struct mm_struct { struct { int mmap_base; union { int start_stack; }; }; }`
    /// with the anonymous struct at 0, `mmap_base` at 0, the anonymous
    /// union at 3712 and `start_stack` at 64 in it.
    fn sample_btf(start_time_bits: u32) -> Vec<u8> {
        let strings =
            b"\0int\0task_struct\0pid\0group_leader\0start_time\0thread\0thread_struct\0sp\0\
                        fsbase\0mm\0mm_struct\0mmap_base\0start_stack\0comm\0";
        let name = |s: &str| {
            let needle = format!("\0{s}\0");
            strings
                .windows(needle.len())
                .position(|w| w == needle.as_bytes())
                .expect("in the table") as u32
                + 1
        };
        let mut types = Vec::new();
        let mut push = |words: &[u32]| {
            for w in words {
                types.extend_from_slice(&w.to_le_bytes());
            }
        };
        push(&[name("int"), 1 << 24, 4, 32]); // 1: INT
        push(&[0, 2 << 24, 1]); // 2: PTR to 1
        push(&[name("task_struct"), (4 << 24) | 6, 512]); // 3: STRUCT, 6 members
        push(&[name("pid"), 1, 0]);
        push(&[name("group_leader"), 2, 64]);
        push(&[name("start_time"), 1, start_time_bits]);
        push(&[name("thread"), 4, 2048]);
        push(&[name("mm"), 2, 1536]);
        push(&[name("comm"), 1, 1600]);
        push(&[name("thread_struct"), (4 << 24) | 2, 16]); // 4: STRUCT, 2 members
        push(&[name("sp"), 1, 0]);
        push(&[name("fsbase"), 1, 64]);
        push(&[name("mm_struct"), (4 << 24) | 1, 1472]); // 5: STRUCT, 1 member
        push(&[0, 6, 0]);
        push(&[0, (4 << 24) | 2, 1472]); // 6: anonymous STRUCT, 2 members
        push(&[name("mmap_base"), 1, 0]);
        push(&[0, 7, 3712]);
        push(&[0, (5 << 24) | 1, 8]); // 7: anonymous UNION, 1 member
        push(&[name("start_stack"), 1, 64]);
        let mut btf = Vec::new();
        btf.extend_from_slice(&BTF_MAGIC.to_le_bytes());
        btf.extend_from_slice(&[1, 0]);
        for word in [
            24u32,
            0,
            types.len() as u32,
            types.len() as u32,
            strings.len() as u32,
        ] {
            btf.extend_from_slice(&word.to_le_bytes());
        }
        btf.extend_from_slice(&types);
        btf.extend_from_slice(strings);
        btf
    }

    #[test]
    fn reads_member_offsets_from_hand_built_btf() {
        assert_eq!(
            TaskLayout::from_btf(&sample_btf(1024)).unwrap(),
            TaskLayout {
                group_leader: 8,
                start_time: 128,
                fsbase: Some(264),
                stack_start: Some(StackStartLayout {
                    mm: 192,
                    start_stack: 472,
                }),
                pid: Some(0),
                comm: Some(200),
            }
        );
        assert!(matches!(
            TaskLayout::from_btf(&sample_btf(1025)),
            Err(LayoutError::Member("start_time"))
        ));
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let btf = sample_btf(1024);
        for len in 0..btf.len() {
            assert!(
                TaskLayout::from_btf(&btf[..len]).is_err(),
                "cut to {len} bytes"
            );
        }
        assert!(matches!(
            TaskLayout::from_btf(b"not BTF at all"),
            Err(LayoutError::NotBtf(_))
        ));
        assert!(matches!(
            TaskLayout::from_btf_file(Path::new("/nonexistent/btf")),
            Err(LayoutError::Read { .. })
        ));
    }
}
