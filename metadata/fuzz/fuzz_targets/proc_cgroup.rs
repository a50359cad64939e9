//! The `/proc/<pid>/cgroup` parser and the container identity of the path
//! it picks, on arbitrary text: a path or none, an identity or none, never
//! a panic; the path is one of the file's own, and an identity's id is 64
//! lower-case hex digits taken from the path.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stackscope_metadata::container::{cgroup_path_from_proc, identify};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Some(path) = cgroup_path_from_proc(text) {
        assert!(path.starts_with('/'));
        assert!(text.contains(path));
    }
    // Any text is also a path someone could hand `identify`.
    for path in [cgroup_path_from_proc(text).unwrap_or_default(), text] {
        if let Some(identity) = identify(path) {
            let id = &identity.container_id;
            assert_eq!(id.len(), 64);
            assert!(id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')));
            assert!(path.contains(id.as_str()));
            if let Some(uid) = &identity.pod_uid {
                assert!(uid.len() == 32 || uid.len() == 36);
                assert!(identity.qos.is_some());
            }
            let _ = (
                identity.runtime.to_string(),
                identity.qos.map(|q| q.to_string()),
            );
        }
    }
});
