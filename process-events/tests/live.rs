//! Live tests against the running kernel: real processes, real records.
//!
//! They need root (a system-wide perf event) and fail without it, saying so.
//! Both tests take a lock so that one's processes do not show up in the
//! other's records.

use std::{
    ffi::OsStr,
    path::Path,
    process::{Command, Stdio},
    sync::Mutex,
};

use stackscope_process_events::{
    Config, DrainStats, Event, EventKind, FileRef, MappingEvents, Mmap,
};

static SERIAL: Mutex<()> = Mutex::new(());

fn require_root() {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() == 0 };
    assert!(
        root,
        "these tests open a system-wide perf event: run them as root"
    );
}

fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write to.
    assert_eq!(
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) },
        0
    );
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Rings big enough that the builds running beside the tests cannot fill
/// them between two drains.
fn open_events() -> MappingEvents {
    MappingEvents::open(&Config {
        data_pages: 512,
        ..Config::default()
    })
    .expect("opening the side-band events as root")
}

/// The GNU build-id in the ELF file at `path`.
fn elf_build_id(path: &Path) -> Option<Vec<u8>> {
    use object::Object as _;
    let data = std::fs::read(path).ok()?;
    let file = object::File::parse(&*data).ok()?;
    file.build_id().ok()?.map(<[u8]>::to_vec)
}

fn file_name(m: &Mmap) -> &[u8] {
    use std::os::unix::ffi::OsStrExt as _;
    m.path().file_name().map_or(&[][..], OsStr::as_bytes)
}

fn describe(e: &Event) -> String {
    match &e.kind {
        EventKind::Mmap(m) => format!(
            "{} cpu{} MMAP {:#x}+{:#x} prot {:?} {:?} {:?}",
            e.time_ns,
            e.cpu,
            m.start,
            m.len,
            m.prot,
            m.path(),
            m.file
        ),
        other => format!("{} cpu{} {other:?}", e.time_ns, e.cpu),
    }
}

#[test]
fn short_lived_processes_are_seen_from_fork_to_exit() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    require_root();
    let mut events = open_events();
    eprintln!("{events:?}");
    events.drain_sorted(|_| {}); // what happened before the test

    let true_path = std::fs::canonicalize("/bin/true").unwrap();
    let before = monotonic_ns();
    let mut children = Vec::new();
    for _ in 0..3 {
        let mut child = Command::new("/bin/true").spawn().unwrap();
        children.push(child.id());
        assert!(child.wait().unwrap().success());
    }
    // A program that maps a library after start-up, with dlopen.
    let dlopen = Command::new("python3")
        .args(["-c", "import ctypes; ctypes.CDLL('libz.so.1')"])
        .stderr(Stdio::null())
        .spawn()
        .ok()
        .and_then(|mut child| {
            let pid = child.id();
            child.wait().ok()?.success().then_some(pid)
        });
    let after = monotonic_ns();

    let mut all = Vec::new();
    let stats = events.drain_sorted(|e| all.push(e));
    eprintln!("{stats:?}");
    assert_eq!(stats.parse_errors, 0);
    assert_eq!(stats.resyncs, 0);
    assert!(all.windows(2).all(|w| w[0].time_ns <= w[1].time_ns));

    let me = std::process::id();
    let want_build_id = elf_build_id(&true_path);
    for (i, &pid) in children.iter().enumerate() {
        let mine: Vec<&Event> = all.iter().filter(|e| e.pid() == Some(pid)).collect();
        if i == 0 {
            eprintln!("events of /bin/true (pid {pid}):");
            for e in &mine {
                eprintln!("  {}", describe(e));
            }
        }
        assert!(
            stats.lost == 0 || !mine.is_empty(),
            "records lost: {stats:?}"
        );
        for e in &mine {
            assert!(
                e.time_ns >= before && e.time_ns <= after,
                "{} outside [{before}, {after}]",
                describe(e)
            );
        }
        let position = |pred: &dyn Fn(&Event) -> bool| {
            mine.iter()
                .position(|e| pred(e))
                .unwrap_or_else(|| panic!("pid {pid}: missing event; have {mine:#?}"))
        };
        let fork = position(
            &|e| matches!(e.kind, EventKind::Fork(f) if f.pid == pid && f.tid == pid && f.ppid == me && f.is_new_process()),
        );
        let comm = position(
            &|e| matches!(e.kind, EventKind::Comm(c) if c.exec && c.pid == pid && c.name.as_bytes() == b"true"),
        );
        let exe =
            position(&|e| matches!(&e.kind, EventKind::Mmap(m) if m.path() == true_path && m.exec));
        let exit = position(
            &|e| matches!(e.kind, EventKind::Exit(x) if x.pid == pid && x.tid == pid && x.is_leader()),
        );
        for name in [&b"libc.so.6"[..], b"ld-linux-x86-64.so.2"] {
            position(&|e| {
                matches!(&e.kind, EventKind::Mmap(m) if file_name(m) == name && m.exec
                    && m.prot.is_some_and(|p| p & libc::PROT_EXEC as u32 != 0))
            });
        }
        let time = |i: usize| mine[i].time_ns;
        assert!(
            fork < comm && comm < exe && exe < exit,
            "order {fork} {comm} {exe} {exit}"
        );
        assert!(
            time(fork) < time(comm) && time(comm) < time(exe) && time(exe) < time(exit),
            "times {} {} {} {}",
            time(fork),
            time(comm),
            time(exe),
            time(exit)
        );
        let EventKind::Mmap(m) = &mine[exe].kind else {
            unreachable!()
        };
        assert!(m.prot.unwrap() & libc::PROT_EXEC as u32 != 0);
        if events.build_ids() {
            let want = want_build_id.as_deref().expect("/bin/true has a build-id");
            match m.file {
                FileRef::BuildId(id) => assert_eq!(id.as_bytes(), want),
                other => panic!("no build-id for {:?}: {other:?}", m.path()),
            }
        }
        // The libraries' build-ids, when the kernel gave them, are theirs.
        for e in &mine {
            if let EventKind::Mmap(m) = &e.kind
                && let FileRef::BuildId(id) = m.file
                && let Some(want) = elf_build_id(m.path())
            {
                assert_eq!(id.as_bytes(), want, "{:?}", m.path());
            }
        }
    }

    // How often the kernel could not read a build-id of a file mapping.
    let (mut with_id, mut without_id) = (Vec::new(), Vec::new());
    for e in &all {
        if let EventKind::Mmap(m) = &e.kind {
            match m.file {
                FileRef::BuildId(_) => with_id.push(m.path()),
                FileRef::Inode { ino, .. } if ino != 0 => without_id.push(m.path()),
                _ => {}
            }
        }
    }
    eprintln!(
        "file mappings with a build-id: {}, with device and inode only: {} {without_id:?}",
        with_id.len(),
        without_id.len()
    );

    match dlopen {
        Some(pid) => {
            let libz: Vec<&Event> = all
                .iter()
                .filter(|e| {
                    matches!(&e.kind, EventKind::Mmap(m) if m.pid == pid && m.exec
                        && file_name(m).starts_with(b"libz.so"))
                })
                .collect();
            assert!(
                !libz.is_empty(),
                "no exec mapping of libz for python3 (pid {pid})"
            );
            eprintln!("python3's dlopen of libz: {}", describe(libz[0]));
            let comm = all
                .iter()
                .find(|e| matches!(e.kind, EventKind::Comm(c) if c.exec && c.pid == pid))
                .expect("python3's exec");
            assert!(comm.time_ns < libz[0].time_ns);
        }
        None => eprintln!("python3 with ctypes and libz.so.1 not available: dlopen not checked"),
    }
}

#[test]
fn a_small_ring_wraps_and_overflows_cleanly() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    require_root();
    // One page per CPU: about six fork+exec+exit cycles fit.
    let mut events = MappingEvents::open(&Config {
        data_pages: 1,
        ..Config::default()
    })
    .unwrap();
    events.drain(|_| {});

    // Drained after every child: records wrap around the end of the ring
    // again and again, and every child is seen whole.
    let mut total = DrainStats::default();
    for _ in 0..40 {
        let mut child = Command::new("/bin/true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        let mut kinds = Vec::new();
        let stats = events.drain_sorted(|e| {
            if e.pid() == Some(pid) {
                kinds.push(std::mem::discriminant(&e.kind));
            }
        });
        total += stats;
        if stats.lost == 0 {
            assert!(
                kinds.len() >= 7,
                "pid {pid}: {} events, {stats:?}",
                kinds.len()
            );
        }
    }
    assert_eq!((total.parse_errors, total.resyncs), (0, 0), "{total:?}");
    assert!(total.bytes > 2 * events.ring_size() as u64, "{total:?}");

    // Not drained: the ring fills, and the kernel says how much it dropped.
    for _ in 0..40 {
        Command::new("/bin/true").status().unwrap();
    }
    let mut stats = events.drain(|_| {});
    eprintln!("after 40 undrained children: {stats:?}");
    // The kernel writes the LOST record only once there is room again,
    // before the next record it can write into the ring that lost some: it
    // shows in a later drain, once a child has run on that CPU. Children
    // are pinned to each CPU in turn: left to the scheduler, an idle
    // machine may run them all on the CPU whose ring lost nothing.
    let cpus: Vec<u32> = events.cpus().collect();
    for cpu in cpus.iter().cycle().take(40) {
        if stats.lost_records > 0 {
            break;
        }
        Command::new("taskset")
            .args(["-c", &cpu.to_string(), "/bin/true"])
            .status()
            .unwrap();
        stats += events.drain(|_| {});
    }
    eprintln!("after draining and more children: {stats:?}");
    assert!(stats.lost_records >= 1 && stats.lost > 0, "{stats:?}");
    assert_eq!((stats.parse_errors, stats.resyncs), (0, 0), "{stats:?}");
}
