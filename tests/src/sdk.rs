//! Real clients of Pyroscope's APIs that nobody here wrote, installed once
//! per target directory: PyPI's `pyroscope-io` (the Python SDK) and
//! `connectrpc` (a Connect client, its code generated from the querier's
//! `.proto` files with `grpcio-tools`' protoc), and npm's
//! `@pyroscope/nodejs`. Versions are pinned: their wire behaviour is what
//! the tests check the collector against.
//!
//! Installing is idempotent (a marker file names what was installed) and
//! serialised between the tests of one binary.

use std::{
    path::{Path, PathBuf},
    process::Command,
    sync::{Mutex, PoisonError},
};

/// The Python packages, pinned.
const PYTHON_PACKAGES: &[&str] = &[
    "pyroscope-io==1.4.0",
    "connectrpc==0.13.0",
    "protoc-gen-connectrpc==0.13.0",
    "grpcio-tools==1.85.1",
    "protobuf==7.36.2",
];
/// The Node SDK, pinned.
const NODE_PACKAGE: &str = "@pyroscope/nodejs@0.6.4";

/// How the installation is laid out: a change here reinstalls.
const LAYOUT: u32 = 2;

/// The Pyroscope `.proto` files the Connect client is generated from.
const QUERIER_PROTOS: &[&str] = &[
    "types/v1/types.proto",
    "querier/v1/querier.proto",
    "google/v1/profile.proto",
];

/// Where the clients are.
pub struct SdkClients {
    /// The virtualenv's `python`, with the SDK and the Connect client.
    pub python: PathBuf,
    /// The generated querier client's modules (for `PYTHONPATH`; Pyroscope's
    /// `types.v1` is `pyroscope_types.v1` there).
    pub generated: PathBuf,
    /// A directory whose `node_modules` has the Node SDK (for `NODE_PATH`).
    pub node_modules: PathBuf,
}

fn run(command: &mut Command, what: &str) {
    let out = command
        .output()
        .unwrap_or_else(|err| panic!("{what}: {err}"));
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The clients, installed under the target directory if they are not yet.
pub fn sdk_clients() -> SdkClients {
    static INSTALLING: Mutex<()> = Mutex::new(());
    let _one_at_a_time = INSTALLING.lock().unwrap_or_else(PoisonError::into_inner);
    let root = crate::in_target_dir("sdk-clients");
    let protos = Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto/pyroscope");
    let clients = SdkClients {
        python: root.join("venv/bin/python"),
        generated: root.join("generated"),
        node_modules: root.join("node/node_modules"),
    };
    // What was installed, how, and from which .proto files.
    let wanted = format!(
        "{PYTHON_PACKAGES:?} {NODE_PACKAGE} layout {LAYOUT}\n{}",
        QUERIER_PROTOS
            .iter()
            .map(|p| std::fs::read_to_string(protos.join(p)).unwrap_or_default())
            .collect::<String>()
    );
    let marker = root.join("installed");
    if std::fs::read_to_string(&marker).is_ok_and(|had| had == wanted) {
        return clients;
    }
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(root.join("node")).expect("creating the clients' directory");
    // Debian's python3 (3.11; connectrpc needs 3.11 or later).
    run(
        Command::new("/usr/bin/python3")
            .args(["-m", "venv"])
            .arg(root.join("venv")),
        "python3 -m venv (Debian's python3-venv: `cargo xtask setup`)",
    );
    run(
        Command::new(&clients.python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .args(PYTHON_PACKAGES),
        "pip install (PyPI must be reachable)",
    );
    std::fs::create_dir_all(&clients.generated).expect("creating the generated code's directory");
    run(
        Command::new(&clients.python)
            .args(["-m", "grpc_tools.protoc"])
            .arg(format!("-I{}", protos.display()))
            .arg(format!("--python_out={}", clients.generated.display()))
            .arg(format!(
                "--plugin=protoc-gen-connectrpc={}",
                root.join("venv/bin/protoc-gen-connectrpc").display()
            ))
            .arg(format!("--connectrpc_out={}", clients.generated.display()))
            .arg("--connectrpc_opt=protobuf=google")
            .args(QUERIER_PROTOS),
        "generating the Connect client",
    );
    // Pyroscope's `types.v1` would be the Python module `types`, which the
    // standard library's `types` shadows: it becomes `pyroscope_types`.
    let generated = &clients.generated;
    std::fs::rename(generated.join("types"), generated.join("pyroscope_types"))
        .expect("renaming the generated types package");
    for package in ["querier/v1", "google/v1", "pyroscope_types/v1"] {
        for entry in std::fs::read_dir(generated.join(package)).expect("generated code") {
            let path = entry.expect("a generated file").path();
            let text = std::fs::read_to_string(&path).expect("reading generated code");
            std::fs::write(
                &path,
                text.replace("from types.v1", "from pyroscope_types.v1"),
            )
            .expect("writing generated code");
        }
    }
    run(
        Command::new("npm")
            .args(["install", "--silent", "--no-audit", "--no-fund", "--prefix"])
            .arg(root.join("node"))
            .arg(NODE_PACKAGE),
        "npm install (the npm registry must be reachable)",
    );
    std::fs::write(&marker, wanted).expect("writing the marker");
    clients
}
