//! Seeds of the fuzz targets, made at run time: from this machine's own
//! files (`/proc/self/maps`, `/bin/true`'s `.eh_frame`), from fixture
//! programs built here, or written field by field the way the producer
//! (the kernel, the BPF program, a JIT, an agent) writes them. A seed only
//! has to get the fuzzer past the first checks; none is checked in.

use std::{path::Path, process::Command};

use agent_common::{
    PROCESS_EVENT_SIZE, ProcessEvent, RecordKind, SAMPLE_HEADER_SIZE, SampleHeader, sample_flags,
    tail_span,
};
use anyhow::Context as _;
use object::{Object as _, ObjectSection as _};
use prost::Message as _;
use stackscope_test_fixtures::{Fixture, batches};

/// (file name, bytes) of each seed.
pub(super) type Seeds = anyhow::Result<Vec<(String, Vec<u8>)>>;

fn seed(name: &str, bytes: impl Into<Vec<u8>>) -> (String, Vec<u8>) {
    (name.to_string(), bytes.into())
}

/// The bytes of section `name` of the ELF file at `path`.
fn section(path: &Path, name: &str) -> anyhow::Result<Vec<u8>> {
    let data = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let file =
        object::File::parse(&*data).with_context(|| format!("parsing {}", path.display()))?;
    let section = file
        .section_by_name(name)
        .with_context(|| format!("{} has no {name}", path.display()))?;
    Ok(section.data()?.to_vec())
}

/// `debug_frame_only.c` (CFI in `.debug_frame` only), plain and with its
/// debug sections compressed by objcopy (zlib): small whole ELF files.
fn debug_frame_fixtures() -> Seeds {
    let fixture = Fixture::compile_with(
        "debug_frame_only",
        "gcc",
        &["debug_frame_only.c"],
        &[
            "-O1",
            "-g",
            "-nostdlib",
            "-static",
            "-fno-asynchronous-unwind-tables",
            "-fno-unwind-tables",
        ],
    );
    let compressed = fixture.dir().join("zlib");
    crate::run_checked(
        Command::new("objcopy")
            .arg("--compress-debug-sections=zlib")
            .arg(&fixture.path)
            .arg(&compressed),
    )?;
    Ok(vec![
        seed("debug-frame-only.elf", std::fs::read(&fixture.path)?),
        seed("debug-frame-zlib.elf", std::fs::read(&compressed)?),
        seed(
            "debug-frame-only.debug_frame",
            section(&fixture.path, ".debug_frame")?,
        ),
    ])
}

pub(super) fn table_compiler() -> Seeds {
    let mut seeds = vec![
        seed("true.elf", std::fs::read("/bin/true")?),
        seed(
            "true.eh_frame",
            section(Path::new("/bin/true"), ".eh_frame")?,
        ),
        seed(
            "env.eh_frame",
            section(Path::new("/usr/bin/env"), ".eh_frame")?,
        ),
    ];
    seeds.extend(debug_frame_fixtures()?);
    Ok(seeds)
}

pub(super) fn table_cache() -> Seeds {
    use stackscope_unwind::UnwindTable;
    let mut seeds = Vec::new();
    for (name, path) in [("true", "/bin/true"), ("env", "/usr/bin/env")] {
        let table = UnwindTable::from_elf(&std::fs::read(path)?)
            .with_context(|| format!("compiling the unwind table of {path}"))?;
        seeds.push(seed(name, table.to_bytes()));
    }
    Ok(seeds)
}

/// The `.gopclntab` of the Go fixture, when Go is installed (the fuzzer
/// starts from nothing otherwise).
pub(super) fn gopclntab() -> Seeds {
    let has_go = Command::new("go")
        .arg("version")
        .output()
        .is_ok_and(|out| out.status.success());
    if !has_go {
        eprintln!("fuzz: no `go` here (Debian's golang-go): gopclntab starts without a seed");
        return Ok(Vec::new());
    }
    let fixture = Fixture::go("go_chain", &["-ldflags=-s -w"]);
    let table = section(&fixture.path, ".gopclntab")?;
    // The same table claiming its first 64 functions only (the header's
    // first word, 8 bytes wide in a 64-bit binary): a run walks 64
    // functions instead of thousands, so the fuzzer tries more inputs.
    let mut few = table.clone();
    if let Some(nfunc) = few.get_mut(8..16) {
        nfunc.copy_from_slice(&64u64.to_le_bytes());
    }
    Ok(vec![
        seed("go_chain", table),
        seed("go_chain-64-functions", few),
    ])
}

/// A sample header's bytes, as the BPF program writes them.
fn header_bytes(header: &SampleHeader) -> Vec<u8> {
    // SAFETY: SampleHeader is `#[repr(C)]`, made of integers with no
    // padding (agent-common asserts its size), so all of its
    // SAMPLE_HEADER_SIZE bytes are initialized.
    unsafe {
        std::slice::from_raw_parts(
            (header as *const SampleHeader).cast::<u8>(),
            SAMPLE_HEADER_SIZE,
        )
    }
    .to_vec()
}

fn event_bytes(event: &ProcessEvent) -> Vec<u8> {
    // SAFETY: as for `header_bytes`: `#[repr(C)]`, integers, no padding.
    unsafe {
        std::slice::from_raw_parts(
            (event as *const ProcessEvent).cast::<u8>(),
            PROCESS_EVENT_SIZE,
        )
    }
    .to_vec()
}

pub(super) fn sample_record() -> Seeds {
    let mut comm = [0u8; 16];
    comm[..5].copy_from_slice(b"redis");
    let header = |kernel: u32, user: u32, tail: u32, spans: u32, flags: u32| SampleHeader {
        kind: RecordKind::Sample as u32,
        flags: sample_flags::USER_REGS | flags,
        tgid: 42,
        tid: 43,
        cpu: 1,
        kernel_stack_len: kernel,
        user_stack_len: user,
        sampling_divisor: 1,
        ktime_ns: 123_456_789,
        cgroup_id: 7,
        user_rip: 0x5555_0000_1234,
        user_rsp: 0x7ffd_0000_0f00,
        user_rbp: 0x7ffd_0000_0f40,
        comm,
        tail_len: tail,
        tail_spans: spans,
        process_start_ns: 1_000,
    };
    let words = |words: &[u64]| -> Vec<u8> { words.iter().flat_map(|w| w.to_ne_bytes()).collect() };

    let mut usual = header_bytes(&header(16, 64, 0, 0, 0));
    usual.extend(words(&[0xffff_ffff_8100_0000, 0xffff_ffff_8100_0100]));
    usual.extend(words(&[0x5555_0000_1300; 8]));

    let mut tail = Vec::new();
    for (addr, len, flags) in [
        (0x7ffd_0000_8000u64, 16u32, 0u64),
        (0x7ffd_0000_9000, 8, tail_span::FAULTED),
    ] {
        let span = tail_span::pack(addr, len).context("a span the sampler could write")? | flags;
        tail.extend(span.to_ne_bytes());
        tail.extend(vec![0xab; len as usize]);
    }
    let mut with_tail = header_bytes(&header(0, 32, tail.len() as u32, 2, 0));
    with_tail.extend(words(&[0x5555_0000_1300; 4]));
    with_tail.extend(&tail);

    let mut deep = header_bytes(&header(8, 64, 0, 0, sample_flags::DEEP_COPY));
    deep.extend(words(&[0xffff_ffff_8100_0000]));
    deep.extend(words(&[0x5555_0000_1300; 8]));
    deep.extend([0xee; 64]);

    let mut direct = header_bytes(&header(8, 1000, 0, 0, sample_flags::DIRECT_COPY));
    direct.extend(words(&[0xffff_ffff_8100_0000]));
    direct.extend([0x13; 1000]);
    direct.extend([0xee; 24]);

    let event = |kind: RecordKind| {
        event_bytes(&ProcessEvent {
            kind: kind as u32,
            tgid: 42,
            ktime_ns: 123_456_789,
        })
    };
    Ok(vec![
        seed("sample", usual),
        seed("sample-with-tail", with_tail),
        seed("deep-sample", deep),
        seed("direct-sample", direct),
        seed("exec", event(RecordKind::Exec)),
        seed("exit", event(RecordKind::Exit)),
    ])
}

/// Perf records as the kernel writes them (host byte order), each with the
/// `sample_id` (pid, tid, time, cpu, res) the agent asks for.
fn perf_records() -> Vec<u8> {
    fn record(kind: u32, misc: u16, payload: &[u8]) -> Vec<u8> {
        let mut body = payload.to_vec();
        for word in [77u32.to_ne_bytes(), 78u32.to_ne_bytes()] {
            body.extend(word);
        }
        body.extend(1_234_567_890u64.to_ne_bytes());
        body.extend(3u32.to_ne_bytes());
        body.extend(0u32.to_ne_bytes());
        let mut out = kind.to_ne_bytes().to_vec();
        out.extend(misc.to_ne_bytes());
        out.extend((8 + body.len() as u16).to_ne_bytes());
        out.extend(body);
        out
    }
    /// A NUL-terminated string padded to 8 bytes.
    fn string(text: &[u8]) -> Vec<u8> {
        let mut out = text.to_vec();
        out.push(0);
        out.resize(out.len().div_ceil(8) * 8, 0);
        out
    }
    let head = |out: &mut Vec<u8>| {
        for word in [4242u32, 4243] {
            out.extend(word.to_ne_bytes());
        }
        for word in [0x5555_0000_0000u64, 0x2000, 0x1000] {
            out.extend(word.to_ne_bytes());
        }
    };
    let prot_flags = |out: &mut Vec<u8>| {
        out.extend(5u32.to_ne_bytes()); // PROT_READ | PROT_EXEC
        out.extend(2u32.to_ne_bytes()); // MAP_PRIVATE
    };

    let mut mmap2 = Vec::new();
    head(&mut mmap2);
    for word in [8u32, 1] {
        mmap2.extend(word.to_ne_bytes());
    }
    for word in [1234u64, 0] {
        mmap2.extend(word.to_ne_bytes());
    }
    prot_flags(&mut mmap2);
    mmap2.extend(string(b"/usr/bin/redis-server"));

    let mut with_build_id = Vec::new();
    head(&mut with_build_id);
    with_build_id.extend([20, 0, 0, 0]);
    with_build_id.extend([0xab; 20]);
    prot_flags(&mut with_build_id);
    with_build_id.extend(string(b"/usr/lib/x86_64-linux-gnu/libc.so.6"));

    let mut mmap = Vec::new();
    head(&mut mmap);
    mmap.extend(string(b"//anon"));

    let mut comm = Vec::new();
    for word in [4242u32, 4242] {
        comm.extend(word.to_ne_bytes());
    }
    comm.extend(string(b"redis-server"));

    let mut task = Vec::new();
    for word in [4244u32, 4242, 4244, 4242] {
        task.extend(word.to_ne_bytes());
    }
    task.extend(1_234_567_000u64.to_ne_bytes());

    let mut lost = 1u64.to_ne_bytes().to_vec();
    lost.extend(12u64.to_ne_bytes());

    [
        record(10, 0, &mmap2),
        record(10, 1 << 14, &with_build_id),
        record(1, 0, &mmap),
        record(3, 1 << 13, &comm),
        record(7, 0, &task),
        record(4, 0, &task),
        record(2, 0, &lost),
    ]
    .concat()
}

pub(super) fn perf_record() -> Seeds {
    let records = perf_records();
    // The first two bytes: where the ring's data area wraps.
    let ring = |split: u16| [split.to_le_bytes().to_vec(), records.clone()].concat();
    Ok(vec![
        seed("records", ring(u16::MAX)),
        seed("records-wrapped", ring(100)),
    ])
}

fn proc_files(name: &str) -> Vec<(String, Vec<u8>)> {
    ["self", "1"]
        .iter()
        .filter_map(|pid| {
            let bytes = std::fs::read(format!("/proc/{pid}/{name}")).ok()?;
            Some(seed(&format!("proc-{pid}-{name}"), bytes))
        })
        .collect()
}

pub(super) fn proc_maps() -> Seeds {
    let mut seeds = proc_files("maps");
    seeds.push(seed(
        "names",
        &b"00400000-00452000 r-xp 00000000 08:02 173521      /usr/bin/redis (deleted)\n\
           7f3a00000000-7f3a00021000 r-xp 00001000 00:01 3072 /memfd:jit-code (deleted)\n\
           7ffd4a5d2000-7ffd4a5f3000 rw-p 00000000 00:00 0                          [stack]\n\
           7ffd4a5f7000-7ffd4a5f9000 r-xp 00000000 00:00 0                          [vdso]\n\
           7f3a00400000-7f3a00401000 rw-s 00000000 00:0e 1234                       anon_inode:[perf_event]\n\
           ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0                  [vsyscall]\n"[..],
    ));
    Ok(seeds)
}

pub(super) fn proc_cgroup() -> Seeds {
    let mut seeds = proc_files("cgroup");
    let id = "3f4a5b6c7d8e9f00112233445566778899aabbccddeeff00112233445566778a";
    for (name, text) in [
        ("podman", format!("0::/libpod_parent/libpod-{id}\n")),
        (
            "kubepods-systemd",
            format!(
                "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0b9d4c5e_1a2b_4c3d_9e8f_001122334455.slice/cri-containerd-{id}.scope\n"
            ),
        ),
        (
            "hybrid-docker",
            format!(
                "12:cpu,cpuacct:/docker/{id}\n11:memory:/docker/{id}\n1:name=systemd:/docker/{id}\n0::/\n"
            ),
        ),
        (
            "kubepods-cgroupfs",
            format!(
                "0::/kubepods/besteffort/pod0b9d4c5e-1a2b-4c3d-9e8f-001122334455/{id} (deleted)\n"
            ),
        ),
    ] {
        seeds.push(seed(name, text));
    }
    Ok(seeds)
}

pub(super) fn mountinfo() -> Seeds {
    let mut seeds = proc_files("mountinfo");
    seeds.push(seed(
        "hybrid",
        "25 30 0:23 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755\n\
         26 25 0:24 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw,nsdelegate\n",
    ));
    Ok(seeds)
}

/// A jitdump stream as V8's `--perf-prof` writes it: the file header, a
/// code load (with its code bytes), a move, and a record of another kind.
fn jitdump_stream() -> Vec<u8> {
    let mut out = Vec::new();
    for word in [0x4A69_5444u32, 1, 40, 62, 0, 4242] {
        out.extend(word.to_le_bytes());
    }
    for word in [1_000u64, 0] {
        out.extend(word.to_le_bytes());
    }
    let name = b"LazyCompile:~hot /app/x.js:3\0";
    let code = [0xccu8; 16];
    let load_size = 16 + 40 + name.len() + code.len();
    for word in [0u32, load_size as u32] {
        out.extend(word.to_le_bytes());
    }
    out.extend(2_000u64.to_le_bytes());
    for word in [4242u32, 4242] {
        out.extend(word.to_le_bytes());
    }
    for word in [0x3ef0_a1c0_c2a0u64, 0x3ef0_a1c0_c2a0, code.len() as u64, 1] {
        out.extend(word.to_le_bytes());
    }
    out.extend(name);
    out.extend(code);
    for word in [1u32, 16 + 48] {
        out.extend(word.to_le_bytes());
    }
    out.extend(3_000u64.to_le_bytes());
    for word in [4242u32, 4242] {
        out.extend(word.to_le_bytes());
    }
    for word in [
        0x3ef0_a1c0_c2a0u64,
        0x3ef0_a1c0_c2a0,
        0x3ef0_a1c0_d000,
        code.len() as u64,
        1,
    ] {
        out.extend(word.to_le_bytes());
    }
    // JIT_CODE_CLOSE: a header only.
    for word in [3u32, 16] {
        out.extend(word.to_le_bytes());
    }
    out.extend(4_000u64.to_le_bytes());
    out
}

pub(super) fn jitdump() -> Seeds {
    let stream = jitdump_stream();
    Ok(vec![
        seed("stream-whole", [&[0u8][..], &stream].concat()),
        seed("stream-cut", [&[13u8][..], &stream].concat()),
    ])
}

pub(super) fn perf_map() -> Seeds {
    // Steps separated by 0xff: a selector byte (bit 0: process, bit 1:
    // jitdump file, bit 2: truncate first), then the bytes to append.
    let mut steps = vec![0u8];
    steps.extend(b"3ef0a1c0c2a0 1a4 LazyCompile:~hot /app/x.js:3\n0x1000 0x10 Foo::bar(int)\r\n");
    steps.extend([0xff, 1]);
    steps.extend(b"2000 100 other-process\n3000 100 partial-li");
    steps.extend([0xff, 1]);
    steps.extend(b"ne\n2080 10 overlapping\n");
    steps.extend([0xff, 2]);
    steps.extend(jitdump_stream());
    steps.extend([0xff, 4]);
    steps.extend(b"1000 10 after-truncation\n");
    Ok(vec![seed("steps", steps)])
}

pub(super) fn ingest_batch() -> Seeds {
    let batch = batches::batch(1, "node-a", "redis-server", 10, 2);
    let mut with_segments = batch.clone();
    if let Some(mapping) = with_segments.mappings.first_mut() {
        mapping
            .load_segments
            .push(stackscope_proto::v1::LoadSegment {
                file_offset: 0x1000,
                vaddr: 0x401000,
                file_size: 0x2000,
            });
    }
    Ok(vec![
        seed("batch", batch.encode_to_vec()),
        seed("batch-with-segments", with_segments.encode_to_vec()),
    ])
}

pub(super) fn selector() -> Seeds {
    // Lines: selector, since, start, end.
    Ok([
        ("braced", "{comm=\"redis\", exe=~\".*/redis.*\"}\n5m\n\n"),
        (
            "bare",
            "pod!=\"\",container!~\"side(car)?\",node=\"a\\\"b\\\\c\"\n\n2026-11-21T17:00:00Z\nnow",
        ),
        ("times", "\n\n1800000000.5\n15m"),
        ("empty", "{}\n2h30m"),
    ]
    .into_iter()
    .map(|(name, text)| seed(name, text))
    .collect())
}
