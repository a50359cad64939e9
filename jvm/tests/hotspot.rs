//! Reads real HotSpot JVMs (Debian's OpenJDK 17, and any other JDK under
//! /usr/lib/jvm) and checks what the readers find against the JVM's own
//! account of its code cache (`jcmd PID Compiler.codelist`).

use std::{
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use stackscope_jvm::BlobKind;
use stackscope_unwind::{RuntimeStep, UnwindRule};

/// A Java program whose hot methods are compiled within a second.
const CHAIN: &str = r#"
public class Chain {
    static long sink;
    static long leaf(long x) { long s = 0; for (int i = 0; i < 1000; i++) { s += (x ^ i) * 31 + (s >>> 3); } return s; }
    static long middle(long x) { return leaf(x) + leaf(x + 1); }
    static long outer(long x) { return middle(x) ^ middle(x * 3); }
    public static void main(String[] args) throws Exception {
        long end = System.nanoTime() + Long.parseLong(args[0]) * 1_000_000L;
        long x = 0;
        while (System.nanoTime() < end) { x = outer(x + 1); sink += x; }
        System.out.println(sink);
    }
}
"#;

struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
        // Killed, the JVM leaves the socket `jcmd` attached through.
        let _ = std::fs::remove_file(format!("/tmp/.java_pid{}", self.0.id()));
    }
}

fn compile(dir: &Path) {
    std::fs::write(dir.join("Chain.java"), CHAIN).expect("writing Chain.java");
    // javac's own JVM would leave /tmp/hsperfdata_<user> behind.
    let status = Command::new("javac")
        .arg("-J-XX:-UsePerfData")
        .arg("Chain.java")
        .current_dir(dir)
        .status()
        .expect("javac: install a JDK (default-jdk-headless)");
    assert!(status.success());
}

/// One line of `Compiler.codelist`: compile id, method, blob start, code.
struct Listed {
    compile_id: i32,
    /// 0: a native method's wrapper; 1-4: C1 and C2 tiers.
    level: u32,
    method: String,
    start: u64,
    code_begin: u64,
}

fn codelist(jcmd: &Path, pid: u32) -> Vec<Listed> {
    let out = Command::new(jcmd)
        // Its own JVM would leave /tmp/hsperfdata_<user> behind.
        .arg("-J-XX:-UsePerfData")
        .args([&pid.to_string(), "Compiler.codelist"])
        .output()
        .expect("running jcmd");
    let hex = |s: &str| {
        u64::from_str_radix(
            s.trim_matches(|c| c == '[' || c == ']' || c == ',')
                .trim_start_matches("0x"),
            16,
        )
        .ok()
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 7 {
                return None;
            }
            Some(Listed {
                compile_id: fields[0].parse().ok()?,
                level: fields[1].parse().ok()?,
                method: fields[3].split('(').next()?.to_owned(),
                start: hex(fields[4])?,
                code_begin: hex(fields[5])?,
            })
        })
        .collect()
}

#[test]
fn compiled_methods_are_found_and_named_as_the_jvm_lists_them() {
    let homes = stackscope_test_fixtures::jdk_homes();
    if homes.is_empty() {
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    compile(dir.path());
    for home in homes {
        let child = Command::new(home.join("bin/java"))
            .args([
                // Killed when done, it would leave its perf data file.
                "-XX:-UsePerfData",
                "-XX:CompileCommand=quiet",
                "-XX:CompileCommand=dontinline,Chain::*",
                "-cp",
            ])
            .arg(dir.path())
            .args(["Chain", "60000"])
            .stdout(Stdio::null())
            .spawn()
            .expect("starting java");
        let running = Running(child);
        let pid = running.0.id();
        let deadline = Instant::now() + Duration::from_secs(30);
        let listed = loop {
            let listed = codelist(&home.join("bin/jcmd"), pid);
            let chain = ["Chain.leaf", "Chain.middle", "Chain.outer"];
            if chain.iter().all(|m| listed.iter().any(|l| l.method == *m)) {
                break listed;
            }
            assert!(
                Instant::now() < deadline,
                "{}: Chain's methods never compiled",
                home.display()
            );
            std::thread::sleep(Duration::from_millis(200));
        };
        let jvm = stackscope_jvm::find_in_process(Path::new("/proc"), pid)
            .unwrap_or_else(|e| panic!("{}: {e}", home.display()))
            .expect("HotSpot's libjvm.so");
        let mut checked = 0;
        for entry in &listed {
            let Some(blob) = jvm.blob_at(entry.code_begin + 1) else {
                // Freed since it was listed (a method recompiled at a higher tier).
                continue;
            };
            assert_eq!(
                blob.start,
                entry.start,
                "{}: {}",
                home.display(),
                entry.method
            );
            let native = entry.level == 0;
            let kind = if native {
                BlobKind::NativeNmethod
            } else {
                BlobKind::Nmethod
            };
            assert_eq!(blob.kind, kind, "{}", entry.method);
            assert_eq!(blob.compile_id, entry.compile_id);
            assert!(blob.frame_bytes >= 16, "{blob:?}");
            let frames = jvm
                .compiled_frames(entry.code_begin + 1, entry.code_begin + 1, true)
                .expect("named");
            // Inlined methods first, the compiled method last.
            assert_eq!(
                frames.last().map(|name| &**name),
                Some(entry.method.as_str()),
                "{}",
                home.display()
            );
            // A return address: the frame is built.
            assert_eq!(
                jvm.step_at(entry.code_begin + 0x10, false),
                Some(RuntimeStep::Rule(UnwindRule::RspRbpSaved {
                    cfa_off: blob.frame_bytes as i32,
                    rbp_off: -16
                }))
            );
            if native {
                // Interrupted in a native method's wrapper, the walk stops.
                assert_eq!(jvm.step_at(entry.code_begin + 1, true), None);
                checked += 1;
                continue;
            }
            // Interrupted at its first instruction (the inline cache check,
            // before the frame is built), nothing is pushed.
            let complete = blob
                .frame_complete
                .expect("an nmethod's frame is complete somewhere");
            let verified = blob.verified_entry.expect("an nmethod's verified entry");
            assert!(
                entry.code_begin <= verified && verified < complete,
                "{blob:?}"
            );
            if verified > entry.code_begin {
                assert_eq!(
                    jvm.step_at(entry.code_begin, true),
                    Some(RuntimeStep::Rule(UnwindRule::Rsp { cfa_off: 8 }))
                );
            }
            // Its stubs come after its body.
            let stubs = blob.stubs.expect("an nmethod's stubs");
            assert!(stubs > complete && stubs <= blob.end, "{blob:?}");
            assert_eq!(jvm.step_at(stubs, true), None);
            checked += 1;
        }
        assert!(
            checked >= 5,
            "{}: {checked} of {} listed blobs checked",
            home.display(),
            listed.len()
        );
        // What was read is counted in the caches' bytes, and emptied for
        // the memory budget, is read again as asked.
        let cached = jvm.cached_bytes();
        assert!(
            cached >= checked * size_of::<stackscope_jvm::CodeBlob>(),
            "{}: {checked} blobs cached in {cached} bytes",
            home.display()
        );
        jvm.clear_caches();
        assert_eq!(jvm.cached_bytes(), 0);
        let last = listed
            .iter()
            .rev()
            .find(|entry| jvm.blob_at(entry.code_begin + 1).is_some())
            .expect("a listed blob still there");
        assert!(
            jvm.compiled_frames(last.code_begin + 1, last.code_begin + 1, true)
                .is_some_and(
                    |frames| frames.last().map(|name| &**name) == Some(last.method.as_str())
                ),
            "{}: {} not named again after the caches were emptied",
            home.display(),
            last.method
        );
        assert!(jvm.cached_bytes() > 0);
        eprintln!(
            "{}: {checked} compiled methods found and named, {cached} bytes cached",
            home.display()
        );
    }
}
