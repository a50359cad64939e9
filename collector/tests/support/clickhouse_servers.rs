//! Two real `clickhouse-server` processes on 127.0.0.1, started once per
//! test binary and shared by its tests: shard 1 and shard 2 of a cluster
//! named [`CLUSTER`] (`remote_servers`, one replica per shard, no
//! ZooKeeper). Each test uses a database of its own.
//!
//! And, on first use, a current ClickHouse engine ([`current_url`]): chdb
//! from PyPI, which embeds one, behind the HTTP interface by
//! `chdb_http.py`, so the statements the collector sends to 18.16 also run
//! on a current release.
//!
//! The servers die with the test binary whatever way it ends: `atexit`
//! kills them and removes their directory when the binary exits (statics
//! are never dropped), and `PR_SET_PDEATHSIG` kills them if the binary is
//! killed. The death signal fires when the *thread* that spawned a child
//! exits, so they are spawned from a thread that never does.
#![allow(dead_code)]

use stackscope_collector::storage::clickhouse::client::{Client, Endpoint};
use std::{
    net::TcpListener,
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Mutex, OnceLock, mpsc},
    time::{Duration, Instant},
};

/// The cluster both servers are shards of.
pub const CLUSTER: &str = "two";

/// The running servers.
#[derive(Debug)]
pub struct Servers {
    /// HTTP ports of shard 1 and shard 2.
    pub http_ports: [u16; 2],
    pub dir: PathBuf,
}

impl Servers {
    /// A `clickhouse://` URL of both shards (cluster mode), database `db`.
    pub fn cluster_url(&self, db: &str) -> String {
        let [a, b] = self.http_ports;
        format!("clickhouse://127.0.0.1:{a},127.0.0.1:{b}/{db}?cluster={CLUSTER}")
    }

    /// A URL of shard 1 alone, without a cluster.
    pub fn single_url(&self, db: &str) -> String {
        format!("clickhouse://127.0.0.1:{}/{db}", self.http_ports[0])
    }

    /// Runs `sql` on one server (0 or 1), panicking with the server's
    /// message if it fails; returns the answer as text.
    pub fn sql(&self, server: usize, sql: &str) -> String {
        let answer = client()
            .query(&endpoint(self.http_ports[server]), sql)
            .unwrap_or_else(|err| panic!("{sql:?} failed: {err}"));
        String::from_utf8(answer).expect("a text answer")
    }
}

/// The engine's own HTTP client, for statements of the tests' own.
fn client() -> Client {
    Client::new(Duration::from_secs(5), Duration::from_secs(60), 1 << 30).expect("an HTTP client")
}

fn endpoint(port: u16) -> Endpoint {
    Endpoint {
        url: format!("http://127.0.0.1:{port}/"),
        user: None,
        password: None,
    }
}

static SERVERS: OnceLock<Servers> = OnceLock::new();
/// The current engine's HTTP port.
static CURRENT: OnceLock<u16> = OnceLock::new();
/// chdb's release: ClickHouse 26.9 inside.
const CHDB: &str = "chdb==4.4.0";
/// What `atexit` cleans up.
static CHILDREN: Mutex<Vec<Child>> = Mutex::new(Vec::new());
static DIR: Mutex<Option<PathBuf>> = Mutex::new(None);

/// The servers, started on first use.
pub fn servers() -> &'static Servers {
    SERVERS.get_or_init(start)
}

fn find_binary() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin".into(), "/usr/bin".into()])
        .map(|dir| dir.join("clickhouse-server"))
        .find(|candidate| candidate.is_file())
        .unwrap_or_else(|| {
            panic!(
                "clickhouse-server is not installed; run `cargo xtask setup` (it installs \
                 Debian's clickhouse-server package) and run the tests again"
            )
        })
}

/// Ports nothing listens on now (held together, so they differ).
fn free_ports<const N: usize>() -> [u16; N] {
    let listeners: Vec<TcpListener> = (0..N)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind a free port"))
        .collect();
    std::array::from_fn(|i| listeners[i].local_addr().expect("port").port())
}

extern "C" fn stop_servers() {
    if let Ok(mut children) = CHILDREN.lock() {
        for child in children.iter_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
    if let Ok(dir) = DIR.lock()
        && let Some(dir) = dir.as_ref()
    {
        let _ = std::fs::remove_dir_all(dir);
    }
}

const USERS_XML: &str = "<yandex>
  <profiles><default></default></profiles>
  <users>
    <default>
      <password></password>
      <networks><ip>127.0.0.1</ip><ip>::1</ip></networks>
      <profile>default</profile>
      <quota>default</quota>
    </default>
  </users>
  <quotas><default><interval><duration>3600</duration><queries>0</queries><errors>0</errors>
    <result_rows>0</result_rows><read_rows>0</read_rows><execution_time>0</execution_time>
  </interval></default></quotas>
</yandex>
";

fn config_xml(dir: &Path, http: u16, tcp: u16, tcp_ports: [u16; 2]) -> String {
    let dir = dir.display();
    let [a, b] = tcp_ports;
    format!(
        "<yandex>
  <logger><level>warning</level><log>{dir}/server.log</log><errorlog>{dir}/error.log</errorlog></logger>
  <http_port>{http}</http_port>
  <tcp_port>{tcp}</tcp_port>
  <listen_host>127.0.0.1</listen_host>
  <path>{dir}/data/</path>
  <tmp_path>{dir}/tmp/</tmp_path>
  <users_config>{dir}/../users.xml</users_config>
  <mark_cache_size>67108864</mark_cache_size>
  <remote_servers>
    <{CLUSTER}>
      <shard><replica><host>127.0.0.1</host><port>{a}</port></replica></shard>
      <shard><replica><host>127.0.0.1</host><port>{b}</port></replica></shard>
    </{CLUSTER}>
  </remote_servers>
</yandex>
"
    )
}

fn start() -> Servers {
    let binary = find_binary();
    let dir = tempfile::Builder::new()
        .prefix("clickhouse-")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .expect("a directory for the servers")
        .keep();
    *DIR.lock().expect("dir lock") = Some(dir.clone());
    // SAFETY: registers a plain function without arguments; it only locks
    // mutexes that are never held across a panic point of this module.
    let registered = unsafe { libc::atexit(stop_servers) };
    assert_eq!(registered, 0, "atexit failed");

    let [http1, http2, tcp1, tcp2] = free_ports::<4>();
    let tcp_ports = [tcp1, tcp2];
    std::fs::write(dir.join("users.xml"), USERS_XML).expect("write users.xml");
    let mut commands = Vec::new();
    for (i, (http, tcp)) in [(http1, tcp1), (http2, tcp2)].into_iter().enumerate() {
        let server_dir = dir.join(format!("shard{}", i + 1));
        for sub in ["data", "tmp"] {
            std::fs::create_dir_all(server_dir.join(sub)).expect("server dirs");
        }
        let config = server_dir.join("config.xml");
        std::fs::write(&config, config_xml(&server_dir, http, tcp, tcp_ports))
            .expect("write config.xml");
        // A file, not a pipe: nobody reads a pipe while the tests run.
        let stderr = std::fs::File::create(server_dir.join("stderr.log")).expect("stderr.log");
        let mut command = Command::new(&binary);
        command
            .arg(format!("--config-file={}", config.display()))
            .current_dir(&server_dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr);
        commands.push(command);
    }

    spawn_children(commands, &binary);
    let servers = Servers {
        http_ports: [http1, http2],
        dir,
    };
    for (i, port) in servers.http_ports.into_iter().enumerate() {
        wait_ready(&servers.dir.join(format!("shard{}", i + 1)), i, port);
    }
    servers
}

/// Spawns `commands` from a thread that outlives every test (see the
/// module doc), each to die with the test binary, into `CHILDREN`.
fn spawn_children(mut commands: Vec<Command>, binary: &Path) {
    for command in &mut commands {
        // SAFETY: prctl is async-signal-safe and touches no memory of ours.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let (sender, receiver) = mpsc::channel();
    std::thread::Builder::new()
        .name("clickhouse-parent".into())
        .spawn(move || {
            let children: Vec<std::io::Result<Child>> =
                commands.iter_mut().map(Command::spawn).collect();
            let _ = sender.send(children);
            loop {
                std::thread::park();
            }
        })
        .expect("spawn the servers' parent thread");
    for child in receiver.recv().expect("the parent thread answers") {
        let child = child.unwrap_or_else(|err| panic!("starting {}: {err}", binary.display()));
        CHILDREN.lock().expect("children lock").push(child);
    }
}

/// A `clickhouse://` URL of the current engine (one server, no cluster),
/// database `db`; the engine is installed and started on first use.
pub fn current_url(db: &str) -> String {
    let port = *CURRENT.get_or_init(start_current);
    format!("clickhouse://127.0.0.1:{port}/{db}")
}

/// Runs `sql` on the current engine, panicking with its message if it
/// fails; returns the answer as text.
pub fn current_sql(sql: &str) -> String {
    let port = *CURRENT.get_or_init(start_current);
    let answer = client()
        .query(&endpoint(port), sql)
        .unwrap_or_else(|err| panic!("{sql:?} failed: {err}"));
    String::from_utf8(answer).expect("a text answer")
}

fn start_current() -> u16 {
    let python = chdb_python();
    // The 18.16 servers' directory and clean-up serve this one too.
    let dir = servers().dir.join("current");
    std::fs::create_dir_all(&dir).expect("the current engine's directory");
    let [port] = free_ports::<1>();
    let log = |name: &str| std::fs::File::create(dir.join(name)).expect("a log file");
    let mut command = Command::new(&python);
    command
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/chdb_http.py"))
        .arg(port.to_string())
        .arg(&dir)
        .current_dir(&dir)
        .stdin(Stdio::null())
        .stdout(log("stdout.log"))
        .stderr(log("stderr.log"));
    let index = CHILDREN.lock().expect("children lock").len();
    spawn_children(vec![command], &python);
    wait_ready(&dir, index, port);
    port
}

/// The Python of a virtual environment with chdb, made under the target
/// directory once (PyPI must be reachable the first time).
fn chdb_python() -> PathBuf {
    let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join(CHDB.replace("==", "-"));
    let python = root.join("venv/bin/python");
    let has_chdb = |python: &Path| {
        Command::new(python)
            .args(["-c", "import chdb"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|status| status.success())
    };
    if has_chdb(&python) {
        return python;
    }
    let run = |command: &mut Command, what: &str| {
        let output = command
            .output()
            .unwrap_or_else(|err| panic!("{what}: {err}"));
        assert!(
            output.status.success(),
            "{what} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    };
    run(
        Command::new("python3")
            .args(["-m", "venv"])
            .arg(root.join("venv")),
        "python3 -m venv (Debian's python3-venv: `cargo xtask setup`)",
    );
    run(
        Command::new(&python).args(["-m", "pip", "install", "--quiet", CHDB]),
        "pip install chdb (PyPI must be reachable)",
    );
    python
}

/// Waits until the server `index` of `CHILDREN` (its logs in `dir`)
/// answers on `port`.
fn wait_ready(dir: &Path, index: usize, port: u16) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let client = client();
    loop {
        let answer = client.query(&endpoint(port), "SELECT 1");
        if matches!(answer.as_deref(), Ok(b"1\n")) {
            return;
        }
        let mut children = CHILDREN.lock().expect("children lock");
        let child = &mut children[index];
        if let Ok(Some(status)) = child.try_wait() {
            let stderr = std::fs::read_to_string(dir.join("stderr.log")).unwrap_or_default();
            let log = std::fs::read_to_string(dir.join("error.log")).unwrap_or_default();
            panic!("{} exited with {status}: {stderr}{log}", dir.display());
        }
        drop(children);
        assert!(
            Instant::now() < deadline,
            "{} did not answer on port {port} within 60 s: {answer:?}",
            dir.display()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
