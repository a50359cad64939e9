//! What failing tests said, repeated where a reader of a long log looks:
//! the end. libtest prints each failing test's captured output (its panic
//! message among it) when its binary ends, and the whole suite goes on for
//! many minutes after, so in CI's excerpt of the log a failure showed only
//! as `test NAME ... FAILED`, without why.

use std::{
    io::{BufRead as _, BufReader, Write as _},
    process::{Command, Stdio},
    sync::{Arc, Mutex, PoisonError, mpsc},
    time::Duration,
};

use anyhow::{Context as _, bail};

/// Lines kept of one failing test's panic message: enough for an
/// assertion's message with the values it printed, not a whole report.
const LINES_PER_FAILURE: usize = 12;

/// Characters kept of one line (a test may print a whole JSON report on
/// one).
const LINE_CHARS: usize = 600;

/// Failing tests kept (the rest are counted).
const FAILURES_KEPT: usize = 10;

/// How long the output may go on after cargo exited: a test's process
/// left running (a failed test may not reach its clean-up) holds the pipe
/// open, and must not hold up the suite.
const OUTPUT_AFTER_EXIT: Duration = Duration::from_secs(5);

/// Runs `cmd` (a `cargo test`), passing its standard output through, and
/// on failure names each failing test with its panic message.
pub(crate) fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let mut child = cmd
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {cmd:?}"))?;
    let stdout = child.stdout.take().expect("stdout was piped");
    let failures = Arc::new(Mutex::new(Failures::default()));
    let (done, output_ended) = mpsc::channel();
    {
        let failures = Arc::clone(&failures);
        std::thread::spawn(move || {
            pass_through(stdout, &failures);
            let _ = done.send(());
        });
    }
    let status = child.wait().context("waiting for cargo test")?;
    let _ = output_ended.recv_timeout(OUTPUT_AFTER_EXIT);
    if !status.success() {
        let summary = failures
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .summary();
        bail!("{cmd:?} failed with {status}{summary}");
    }
    Ok(())
}

/// Copies `stdout` to ours byte for byte, reading its lines into
/// `failures`, until it ends or fails.
fn pass_through(stdout: impl std::io::Read, failures: &Mutex<Failures>) {
    let mut reader = BufReader::new(stdout);
    let mut line = Vec::new();
    let mut out = std::io::stdout();
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        // The log is what matters most: a closed stdout of ours must not
        // stop the tests.
        let _ = out.write_all(&line).and_then(|()| out.flush());
        let text = String::from_utf8_lossy(&line);
        failures
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .read(text.trim_end_matches(['\n', '\r']));
    }
}

/// The panic messages of the failing tests, read from libtest's
/// `---- NAME stdout ----` sections.
#[derive(Debug, Default)]
struct Failures {
    kept: Vec<(String, Vec<String>)>,
    /// Failing tests beyond `FAILURES_KEPT`.
    more: usize,
    /// Within a failing test's section, taking its panic message.
    state: Section,
}

#[derive(Debug, Default, PartialEq)]
enum Section {
    #[default]
    Outside,
    /// In a section, before the line saying where the test panicked.
    BeforePanic,
    /// From the panic line on, until a backtrace, a note or the section's
    /// end.
    Panic,
}

impl Failures {
    fn read(&mut self, line: &str) {
        if let Some(name) = line
            .strip_prefix("---- ")
            .and_then(|rest| rest.strip_suffix(" stdout ----"))
        {
            if self.kept.len() < FAILURES_KEPT {
                self.kept.push((name.to_string(), Vec::new()));
                self.state = Section::BeforePanic;
            } else {
                self.more += 1;
                self.state = Section::Outside;
            }
            return;
        }
        // The list of names after the sections.
        if line == "failures:" {
            self.state = Section::Outside;
            return;
        }
        // `thread 'NAME' (TID) panicked at FILE:LINE:COL:` (older Rust
        // prints no TID).
        if self.state == Section::BeforePanic
            && line.starts_with("thread '")
            && line.contains(" panicked at ")
        {
            self.state = Section::Panic;
        }
        if self.state != Section::Panic {
            return;
        }
        if line.starts_with("stack backtrace:") || line.starts_with("note: ") {
            self.state = Section::Outside;
            return;
        }
        let Some((_, message)) = self.kept.last_mut() else {
            return;
        };
        if message.len() < LINES_PER_FAILURE {
            message.push(line.chars().take(LINE_CHARS).collect());
        }
    }

    /// `; the failing tests said:` and each one's name and message, or
    /// nothing when no section was read (a build error, a crashed binary).
    fn summary(&self) -> String {
        if self.kept.is_empty() {
            return String::new();
        }
        let mut text = String::from("; the failing tests said:");
        for (name, message) in &self.kept {
            text.push_str(&format!("\n  {name}:"));
            // A section read to its end (a binary's second panic has no
            // note after it) ends with libtest's blank line.
            let shown = message
                .iter()
                .rposition(|line| !line.trim().is_empty())
                .map_or(0, |last| last + 1);
            for line in &message[..shown] {
                match line.trim_end() {
                    "" => text.push('\n'),
                    line => text.push_str(&format!("\n    {line}")),
                }
            }
        }
        if self.more > 0 {
            text.push_str(&format!("\n  and {} more", self.more));
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(output: &str) -> Failures {
        let mut failures = Failures::default();
        for line in output.lines() {
            failures.read(line);
        }
        failures
    }

    #[test]
    fn each_failing_test_is_named_with_its_panic_message_and_nothing_else() {
        let output = "\
test a::passes ... ok
test a::fails ... FAILED
test b::fails ... FAILED

failures:

---- a::fails stdout ----
hostile: the agent's peak RSS 109 MiB
thread 'a::fails' (3012) panicked at tests/a.rs:10:5:
the control program: 12 of 140 walks reached the root
note: run with `RUST_BACKTRACE=1` environment variable to display a backtrace

---- b::fails stdout ----
thread 'b::fails' panicked at tests/b.rs:3:9:
assertion `left == right` failed
  left: 1
 right: 2

failures:
    a::fails
    b::fails

test result: FAILED. 1 passed; 2 failed
";
        assert_eq!(
            read(output).summary(),
            "; the failing tests said:\
             \n  a::fails:\
             \n    thread 'a::fails' (3012) panicked at tests/a.rs:10:5:\
             \n    the control program: 12 of 140 walks reached the root\
             \n  b::fails:\
             \n    thread 'b::fails' panicked at tests/b.rs:3:9:\
             \n    assertion `left == right` failed\
             \n      left: 1\
             \n     right: 2"
        );
    }

    #[test]
    fn a_long_message_and_many_failures_are_cut() {
        let mut output = String::from("failures:\n\n");
        for test in 0..FAILURES_KEPT + 3 {
            output.push_str(&format!(
                "---- t{test} stdout ----\nthread 't{test}' panicked at x.rs:1:1:\n"
            ));
            for line in 0..LINES_PER_FAILURE * 2 {
                output.push_str(&format!("{line} {}\n", "x".repeat(LINE_CHARS)));
            }
        }
        let failures = read(&output);
        assert_eq!(failures.kept.len(), FAILURES_KEPT);
        assert_eq!(failures.more, 3);
        for (_, message) in &failures.kept {
            assert_eq!(message.len(), LINES_PER_FAILURE);
            assert!(
                message
                    .iter()
                    .all(|line| line.chars().count() <= LINE_CHARS)
            );
        }
        assert!(failures.summary().ends_with("\n  and 3 more"));
    }

    #[test]
    fn a_run_without_failure_sections_adds_nothing() {
        assert_eq!(
            read("test a ... ok\n\ntest result: ok. 1 passed\n").summary(),
            ""
        );
    }
}
