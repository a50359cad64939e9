//! The `/proc/<pid>/maps` parser on arbitrary bytes: mappings or an error
//! naming the line, never a panic. A line that parses, printed back the way
//! the kernel prints it, parses to the same mapping (nothing of the name is
//! lost or invented, whatever its bytes).
#![no_main]

use std::os::unix::ffi::OsStrExt as _;

use libfuzzer_sys::fuzz_target;
use stackscope_process_table::maps::{Mapping, MappingPath, parse_line, parse_maps};

/// The line as `show_map_vma` prints it, with the name's bytes verbatim.
fn kernel_line(mapping: &Mapping) -> Vec<u8> {
    let mut line = format!(
        "{:08x}-{:08x} {} {:08x} {} {:<25} ",
        mapping.start, mapping.end, mapping.perms, mapping.offset, mapping.dev, mapping.inode
    )
    .into_bytes();
    let deleted = |line: &mut Vec<u8>, deleted: bool| {
        if deleted {
            line.extend_from_slice(b" (deleted)");
        }
    };
    match &mapping.path {
        MappingPath::File { path, deleted: d } => {
            line.extend_from_slice(path.as_os_str().as_bytes());
            deleted(&mut line, *d);
        }
        MappingPath::Memfd { name, deleted: d } => {
            line.extend_from_slice(b"/memfd:");
            line.extend_from_slice(name);
            deleted(&mut line, *d);
        }
        MappingPath::Other(name) => line.extend_from_slice(name),
        special => line.extend_from_slice(special.to_string().as_bytes()),
    }
    line
}

fuzz_target!(|data: &[u8]| {
    let Ok(mappings) = parse_maps(data) else {
        return;
    };
    let lines: Vec<&[u8]> = data
        .split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .collect();
    assert_eq!(lines.len(), mappings.len());
    for mapping in &mappings {
        assert!(mapping.start <= mapping.end);
        assert_eq!(mapping.len(), mapping.end - mapping.start);
        let _ = mapping.path.shipped_name();
        let again = parse_line(&kernel_line(mapping));
        assert_eq!(again.as_ref(), Ok(mapping), "{mapping:?}");
    }
});
