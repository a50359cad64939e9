//! The cgroup2 mount point from `/proc/self/mountinfo` text: a path or
//! none, never a panic, and the path is one of the text's own fields
//! (unescaped).
#![no_main]

use libfuzzer_sys::fuzz_target;
use stackscope_metadata::cgroups::{cgroup2_mount_in, unescape_mount_field};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Some(mount) = cgroup2_mount_in(text) {
        let mount = mount.to_str().expect("made from a str");
        assert!(!mount.is_empty());
        assert!(
            text.split_whitespace()
                .any(|field| unescape_mount_field(field) == mount)
        );
    }
});
