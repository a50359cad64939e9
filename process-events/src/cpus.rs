//! Which CPUs to open an event on.
//!
//! Owns: parsing the kernel's CPU list format (`/sys/devices/system/cpu/online`:
//! `0-1`, `0,2-5`, with a trailing newline) and reading the online list.
//!
//! Does not own: CPU hotplug. A CPU that comes online after
//! [`MappingEvents::open`](crate::MappingEvents::open) has no event, so what
//! runs there is not seen until the events are reopened.

use std::{io, path::Path};

use thiserror::Error;

/// Where the kernel lists the online CPUs.
pub const ONLINE_CPUS: &str = "/sys/devices/system/cpu/online";

/// More CPUs than any kernel supports (`NR_CPUS` tops out at 8192 today);
/// bounds the list a garbage range like `0-4294967295` would make.
pub const MAX_CPUS: u32 = 1 << 16;

/// Why a CPU list could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CpuListError {
    /// The list is empty (or only whitespace).
    #[error("the CPU list is empty")]
    Empty,
    /// An item is neither a number nor `first-last`.
    #[error("CPU list item {item:?} is not a number or a range")]
    BadItem { item: String },
    /// A range whose last CPU is below its first.
    #[error("CPU range {item:?} ends before it starts")]
    InvertedRange { item: String },
    /// A CPU number at or above [`MAX_CPUS`].
    #[error("CPU list item {item:?} goes beyond {MAX_CPUS} CPUs")]
    TooLarge { item: String },
}

/// Parses a kernel CPU list into sorted, distinct CPU numbers.
pub fn parse_cpu_list(text: &str) -> Result<Vec<u32>, CpuListError> {
    let text = text.trim();
    if text.is_empty() {
        return Err(CpuListError::Empty);
    }
    let mut cpus = Vec::new();
    for item in text.split(',') {
        let bad = || CpuListError::BadItem {
            item: item.to_owned(),
        };
        let number = |s: &str| -> Result<u32, CpuListError> {
            // `u32::from_str` accepts a leading `+`; the kernel never prints one.
            if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
                return Err(bad());
            }
            let n: u32 = s.parse().map_err(|_| bad())?;
            if n >= MAX_CPUS {
                return Err(CpuListError::TooLarge {
                    item: item.to_owned(),
                });
            }
            Ok(n)
        };
        let (first, last) = match item.split_once('-') {
            Some((a, b)) => (number(a)?, number(b)?),
            None => {
                let n = number(item)?;
                (n, n)
            }
        };
        if last < first {
            return Err(CpuListError::InvertedRange {
                item: item.to_owned(),
            });
        }
        cpus.extend(first..=last);
    }
    cpus.sort_unstable();
    cpus.dedup();
    Ok(cpus)
}

/// Reads and parses a CPU list file such as [`ONLINE_CPUS`].
pub(crate) fn read_cpu_list(path: &Path) -> io::Result<Result<Vec<u32>, CpuListError>> {
    Ok(parse_cpu_list(&std::fs::read_to_string(path)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single() {
        assert_eq!(parse_cpu_list("0\n"), Ok(vec![0]));
    }

    #[test]
    fn range() {
        assert_eq!(parse_cpu_list("0-1\n"), Ok(vec![0, 1]));
    }

    #[test]
    fn mixed() {
        assert_eq!(parse_cpu_list("0,2-5"), Ok(vec![0, 2, 3, 4, 5]));
    }

    #[test]
    fn overlapping_and_unsorted() {
        assert_eq!(parse_cpu_list("4-5,0,3-4"), Ok(vec![0, 3, 4, 5]));
    }

    #[test]
    fn empty() {
        assert_eq!(parse_cpu_list(""), Err(CpuListError::Empty));
        assert_eq!(parse_cpu_list("\n"), Err(CpuListError::Empty));
    }

    #[test]
    fn garbage() {
        for (text, item) in [
            ("x", "x"),
            ("0,", ""),
            ("0-", "0-"),
            ("-1", "-1"),
            ("1-2-3", "1-2-3"),
            ("+1", "+1"),
            ("0, 1", " 1"),
            ("99999999999", "99999999999"),
        ] {
            assert_eq!(
                parse_cpu_list(text),
                Err(CpuListError::BadItem { item: item.into() }),
                "{text:?}"
            );
        }
    }

    #[test]
    fn inverted() {
        assert_eq!(
            parse_cpu_list("5-2"),
            Err(CpuListError::InvertedRange { item: "5-2".into() })
        );
    }

    #[test]
    fn too_large() {
        assert_eq!(
            parse_cpu_list("0-4294967295"),
            Err(CpuListError::TooLarge {
                item: "0-4294967295".into()
            })
        );
    }

    #[test]
    fn this_machine() {
        let cpus = read_cpu_list(Path::new(ONLINE_CPUS)).unwrap().unwrap();
        assert!(!cpus.is_empty());
    }
}
