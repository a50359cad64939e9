//! The ClickHouse storage engine, for fleets that outgrow one SQLite file:
//! collectors are stateless in front of one ClickHouse database (one server,
//! or a cluster of shards behind `Distributed` tables), so any number of
//! them ingest and answer queries over the whole fleet's data.
//!
//! Owns the statements that write and read rows, the caches that spare
//! round trips, and the configuration (`clickhouse://` URLs). The DDL is in
//! `schema`, the HTTP client in `client`, row and blob encodings in `codec`.
//! Does not own validation (`ingest`) or symbolization.
//!
//! # How it keeps SQLite's semantics
//!
//! * Items are named by 128-bit content hashes (SQLite's engine computes
//!   the same for stacks; a label set's low 32 bits, its first four bytes
//!   stored, are its node's hash: see `clustered_label_set_id`), so every
//!   collector names a stack or label set alike without coordination;
//!   there are no ids to allocate.
//! * Dedup: a batch id found in `batches`, or still queued to be written
//!   there by this collector, is a duplicate. Its id is written after its
//!   samples (behind ingest, many per insert: see `batch_ids`), so a batch
//!   whose ingest failed half-way is stored again on retry; its sample
//!   rows are then exact duplicates (same batch, bucket, label set, stack,
//!   weight; a former collector's label set ids differ in their first four
//!   bytes: see `ROW_COPY_KEY`). Each try at storing a batch's samples is
//!   first registered in `attempts`: sums add rows as they are, but count
//!   the rows of a batch tried more than once one copy each (see
//!   `summed_sample_rows`). The window left: none for sample weights; two
//!   retries racing through different collectors, or a retry through
//!   another collector before the id is written (within about 100 ms while
//!   the servers take it), both store, and both answer `Stored`.
//! * Where a batch goes: its try, samples and id are written straight to
//!   the own tables of one server, its home shard (picked by its id, see
//!   `batch_servers`), where its id is looked up too: an insert through a
//!   `Distributed` table waits for a second hop on 18.16 (4-5 ms against
//!   1-3 ms for the same rows straight to a shard, measured in `bench
//!   collector`). A home whose HTTP interface cannot be reached sends the
//!   batch to the next server, unchecked for a duplicate (counted once
//!   anyway); a shard that is down altogether still fails the reads and
//!   dictionary inserts, which go through the `Distributed` tables.
//! * No `FINAL` on reads (but `meta`'s, and retention's count): ClickHouse
//!   18.16 reads a `FINAL` table in a single stream per shard, merging
//!   every row of the range on one core. Which label sets exist and their
//!   names and values never needed it.
//! * Buckets: the same `bucket_nanos` alignment (kept in `meta`, refused if
//!   another width is asked for), and a bucket overlapping the range counts
//!   whole.
//! * Sums: weights are summed exactly (in three 21-bit parts, so nothing
//!   wraps) and every total returned, per stack or per series point, is
//!   capped at `i64::MAX`, as SQLite's are. Each stored row is at most
//!   `i64::MAX`, so capping once at the end equals adding capped.
//! * Periods: known only when every selected row agrees on one.
//! * Retention: a high-water mark (`retention`) hides deleted buckets at
//!   once; whole partitions at or before it are dropped. ClickHouse 18.16
//!   has no `TTL`, and `ALTER .. DELETE` mutations rewrite whole parts, so
//!   rows of a partition that is only partly past the cutoff stay on disk
//!   (hidden) until all of it is.
//! * Stacks come back ordered by hash (SQLite: by id, i.e. first storing);
//!   the trait promises no order, and trees and top tables do not depend
//!   on it.

mod batch_ids;
pub mod client;
pub mod codec;
mod rollup;
pub mod schema;

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, SystemTime},
};

use stackscope_profile::model::{
    Frame, PROFILE_TYPE_LABEL, PeriodAgreement, ProfileType, Selection, StackSamples,
    WeightedStack, unix_nanos,
};

use self::{
    client::{ClickhouseError, Client, Endpoint},
    codec::{RowReader, RowWriter},
    rollup::Cover,
    schema::{SCHEMA_VERSION, Tables},
};
use stackscope_telemetry::StateSize;

use super::{
    IngestOutcome, Storage, StorageError,
    codec::resolve_frames,
    hash::{label_set_hash, location_hash, mapping_hash, stack_hash},
    tiers::Tiers,
};
use crate::ingest::ValidBatch;

/// Where the data lives: parsed from
/// `clickhouse://[USER[:PASSWORD]@]HOST:PORT[,HOST:PORT...]/DATABASE[?cluster=NAME]`.
///
/// * One `HOST:PORT` (the HTTP interface, 8123 by default) without
///   `cluster`: a single server, tables used directly.
/// * With `cluster=NAME`: `NAME` is a cluster of the servers'
///   `remote_servers` config, one replica per shard, and the URL lists
///   every shard's HTTP address: the collector creates the tables on each
///   (no `ON CLUSTER`, which needs ZooKeeper) and runs retention on each;
///   reads and dictionary inserts go through the `Distributed` tables of
///   the first server that answers, and each batch's samples to its home
///   shard's own tables.
#[derive(Clone, PartialEq, Eq)]
pub struct ClickhouseConfig {
    /// `http://host:port/`, in the URL's order.
    pub servers: Vec<String>,
    pub user: Option<String>,
    pub password: Option<String>,
    pub database: String,
    pub cluster: Option<String>,
}

impl std::fmt::Debug for ClickhouseConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClickhouseConfig")
            .field("servers", &self.servers)
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "…"))
            .field("database", &self.database)
            .field("cluster", &self.cluster)
            .finish()
    }
}

/// The URL scheme that selects this engine.
pub const URL_SCHEME: &str = "clickhouse://";

impl ClickhouseConfig {
    /// Parses a `clickhouse://` URL (see the type's doc); errors say what is
    /// wrong with it.
    pub fn from_url(url: &str) -> Result<Self, StorageError> {
        let bad = |why: String| {
            StorageError::InvalidOptions(format!(
                "bad ClickHouse URL {:?}: {why}; expected \
                 clickhouse://[USER[:PASSWORD]@]HOST:PORT[,HOST:PORT...]/DATABASE[?cluster=NAME]",
                redact(url)
            ))
        };
        let rest = url
            .strip_prefix(URL_SCHEME)
            .ok_or_else(|| bad(format!("it does not start with {URL_SCHEME}")))?;
        let (rest, query) = match rest.split_once('?') {
            Some((rest, query)) => (rest, Some(query)),
            None => (rest, None),
        };
        let (authority, database) = rest
            .split_once('/')
            .ok_or_else(|| bad("no /DATABASE".into()))?;
        let (credentials, hosts) = match authority.rsplit_once('@') {
            Some((credentials, hosts)) => (Some(credentials), hosts),
            None => (None, authority),
        };
        let (user, password) = match credentials {
            None => (None, None),
            Some(credentials) => match credentials.split_once(':') {
                Some((user, password)) => (Some(user.to_owned()), Some(password.to_owned())),
                None => (Some(credentials.to_owned()), None),
            },
        };
        if user.as_deref() == Some("") {
            return Err(bad("an empty user name".into()));
        }
        let mut servers = Vec::new();
        for host in hosts.split(',') {
            let (name, port) = match host.rsplit_once(':') {
                Some((name, port)) if !name.ends_with(']') || name.starts_with('[') => {
                    (name, Some(port))
                }
                _ => (host, None),
            };
            let port = match port {
                None => 8123,
                Some(port) => port
                    .parse::<u16>()
                    .ok()
                    .filter(|&p| p > 0)
                    .ok_or_else(|| bad(format!("port {port:?} of {host:?} is not a port")))?,
            };
            let valid_name = !name.is_empty()
                && name.bytes().all(|b| {
                    b.is_ascii_alphanumeric()
                        || matches!(b, b'.' | b'-' | b'_' | b'[' | b']' | b':')
                });
            if !valid_name {
                return Err(bad(format!("{host:?} is not HOST:PORT")));
            }
            servers.push(format!("http://{name}:{port}/"));
        }
        if !schema::is_plain_identifier(database, &[]) {
            return Err(bad(format!(
                "database {database:?} is not a plain name (letters, digits, _)"
            )));
        }
        let mut cluster = None;
        for pair in query
            .into_iter()
            .flat_map(|q| q.split('&'))
            .filter(|p| !p.is_empty())
        {
            match pair.split_once('=') {
                Some(("cluster", name)) if schema::is_plain_identifier(name, b"-.") => {
                    cluster = Some(name.to_owned());
                }
                Some(("cluster", name)) => {
                    return Err(bad(format!("cluster {name:?} is not a plain name")));
                }
                _ => {
                    return Err(bad(format!(
                        "unknown parameter {pair:?} (only cluster=NAME)"
                    )));
                }
            }
        }
        if cluster.is_none() && servers.len() > 1 {
            return Err(bad(
                "several servers need ?cluster=NAME (the remote_servers cluster they form)".into(),
            ));
        }
        Ok(Self {
            servers,
            user,
            password,
            database: database.to_owned(),
            cluster,
        })
    }
}

/// `url` without its password, for messages.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let credentials = &url[scheme + 3..at];
            match credentials.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..scheme + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

/// How the ClickHouse engine stores and caches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClickhouseOptions {
    /// Samples are summed per bucket of this many nanoseconds, as with
    /// SQLite; fixed when the database is created.
    pub bucket_nanos: i64,
    /// Rows are partitioned by time in partitions this wide: what
    /// retention drops at a time. Rounded up to a multiple of
    /// `bucket_nanos` (a bucket never straddles two partitions): with
    /// 7-minute buckets a day's partition is 1442 minutes, with 2-day
    /// buckets it is 2 days. Fixed (as rounded) when the database is
    /// created.
    pub partition_nanos: i64,
    /// Entries each ingest cache (stacks, label sets known stored) holds.
    pub cache_entries: usize,
    /// Stacks and label sets whose decoded contents queries keep.
    pub query_cache_entries: usize,
    pub connect_timeout: Duration,
    /// Longest a statement may take, end to end.
    pub request_timeout: Duration,
    /// Most bytes of new dictionary rows (stacks, label sets) one batch may
    /// add. A stack row holds each location's mapping and lines whole (so
    /// a row names a whole stack), so a batch within the ingest limits can
    /// expand many times over; a larger one is refused whole
    /// (`StorageError::TooLarge`), nothing of it stored.
    pub max_batch_dictionary_bytes: usize,
    /// Longest answer read from a server, in bytes (also sent as
    /// `max_result_bytes`): a larger one is an error, not memory.
    pub max_response_bytes: u64,
    /// Stacks or label sets a query names per `IN (...)` list: when it
    /// fetches them, and when it sums the samples of selected label sets
    /// (one query per chunk, added up).
    pub stack_fetch_chunk: usize,
    /// How long the thread that writes batch ids behind ingest waits after
    /// one arrives for those that follow (see `batch_ids`): how late
    /// another collector may see an id, against how many inserts (parts
    /// on the server) the ids take.
    pub batch_id_linger: Duration,
    /// Most batch ids waiting to be written; past it, ingest writes each
    /// batch's id itself.
    pub max_queued_batch_ids: usize,
}

impl Default for ClickhouseOptions {
    fn default() -> Self {
        Self {
            bucket_nanos: 60_000_000_000,
            partition_nanos: 24 * 3600 * 1_000_000_000,
            cache_entries: 1 << 20,
            query_cache_entries: 1 << 18,
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(120),
            stack_fetch_chunk: 4096,
            max_response_bytes: 1 << 30,
            max_batch_dictionary_bytes: 256 << 20,
            batch_id_linger: Duration::from_millis(100),
            max_queued_batch_ids: 16_384,
        }
    }
}

/// How far past now a batch may end: further is refused.
const MAX_FUTURE_NANOS: i64 = 24 * 3600 * 1_000_000_000;

/// A `ClickhouseError` as a storage error, saying what was being done.
fn remote(action: impl Into<String>) -> impl FnOnce(ClickhouseError) -> StorageError {
    let action = action.into();
    move |source| StorageError::Remote {
        action,
        source: Box::new(source),
    }
}

/// A scoped thread's result; its panic goes on in the caller.
fn joined<T>(thread: std::thread::ScopedJoinHandle<'_, T>) -> T {
    thread
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

/// Runs `a` and `b` at once (`b` on this thread): two statements that do
/// not depend on each other wait for one round trip, not two.
fn both<A: Send, B>(a: impl FnOnce() -> A + Send, b: impl FnOnce() -> B) -> (A, B) {
    std::thread::scope(|scope| {
        let a = scope.spawn(a);
        let b = b();
        (joined(a), b)
    })
}

/// A bounded set, cleared when full (as SQLite's ingest caches: the
/// working set refills within a few batches).
struct BoundedSet<T> {
    entries: HashSet<T>,
    capacity: usize,
}

impl<T: std::hash::Hash + Eq> BoundedSet<T> {
    fn new(capacity: usize) -> Self {
        Self {
            entries: HashSet::new(),
            capacity,
        }
    }

    fn insert(&mut self, value: T) {
        if self.entries.len() >= self.capacity {
            self.entries.clear();
        }
        if self.capacity > 0 {
            self.entries.insert(value);
        }
    }
}

/// A bounded map, cleared when full.
struct BoundedMap<K, V> {
    entries: HashMap<K, V>,
    capacity: usize,
}

impl<K: std::hash::Hash + Eq, V> BoundedMap<K, V> {
    fn new(capacity: usize) -> Self {
        Self {
            entries: HashMap::new(),
            capacity,
        }
    }

    fn insert(&mut self, key: K, value: V) {
        if self.entries.len() >= self.capacity {
            self.entries.clear();
        }
        if self.capacity > 0 {
            self.entries.insert(key, value);
        }
    }
}

/// A stack's or location's frames, leaf first, shared.
type Frames = Arc<[Arc<Frame>]>;

/// Labels of a set, sorted by name.
type Labels = Arc<[(String, String)]>;

struct QueryCaches {
    /// Label set hash -> labels. Content-addressed: never stale.
    label_sets: BoundedMap<u128, Labels>,
    /// Stack hash -> frames, leaf first.
    stacks: BoundedMap<u128, Frames>,
    /// A location's bytes in a stack blob (hashed) -> its frames, so stacks
    /// share the frames of a location as SQLite's do.
    locations: BoundedMap<u128, Frames>,
}

/// Storage in a ClickHouse database (see the module doc).
pub struct ClickhouseStorage {
    config: ClickhouseConfig,
    options: ClickhouseOptions,
    endpoints: Vec<Endpoint>,
    /// Indices of `endpoints` sorted by address: whose position a batch's
    /// home shard is picked by (see `batch_servers`).
    by_address: Vec<usize>,
    tables: Tables,
    client: Client,
    /// Batch ids being written behind ingest.
    batch_ids: batch_ids::BatchIdWriter,
    /// (hash, partition) of stacks and label sets this collector stored:
    /// each is written once per partition, not once per batch.
    stored_stacks: Mutex<BoundedSet<(u128, i64)>>,
    stored_label_sets: Mutex<BoundedSet<(u128, i64)>>,
    query_caches: Mutex<QueryCaches>,
    /// The widths rollups are built at (see `rollup`).
    tiers: Tiers,
    /// Sums that merged every row of their range (see `summed_sample_rows`).
    merged_sums: std::sync::atomic::AtomicU64,
    /// Rollup spans sums read instead of their sample rows.
    rollup_spans_read: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for ClickhouseStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClickhouseStorage")
            .field("config", &self.config)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

/// The mutex's value, also after a panic elsewhere: the caches only ever
/// hold content-addressed entries, so a half-made update is harmless.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// `unhex('…')` literals of hashes, comma separated, for `IN (...)`.
fn hash_list(hashes: impl IntoIterator<Item = u128>) -> String {
    let mut sql = String::new();
    for (i, hash) in hashes.into_iter().enumerate() {
        if i > 0 {
            sql.push(',');
        }
        sql.push_str("unhex('");
        for byte in hash.to_le_bytes() {
            sql.push_str(&format!("{byte:02x}"));
        }
        sql.push_str("')");
    }
    sql
}

/// An exact sum read back in three parts: `parts[i]` sums bits
/// `21 * i .. 21 * (i + 1)` of each weight. A part is below 2^22 per row
/// (2^21 for the weights ingest accepts), so its `UInt64` sum cannot wrap
/// below 2^42 rows in one group: more than any range of a real fleet holds.
fn exact_sum(parts: [u64; 3]) -> u128 {
    parts
        .iter()
        .enumerate()
        .map(|(i, &part)| u128::from(part) << (21 * i))
        .sum()
}

/// What every summed weight an engine returns is: the exact total, capped
/// at `i64::MAX` (stored rows are each at most that, so capping once at
/// the end is the same as adding capped).
fn cap(sum: u128) -> u64 {
    sum.min(i64::MAX as u128) as u64
}

/// The partition width for `partition` nanoseconds asked for: the
/// smallest multiple of `bucket` at least as wide (`None` if either is not
/// positive, or it overflows).
fn partition_width(bucket: i64, partition: i64) -> Option<i64> {
    if bucket <= 0 || partition <= 0 {
        return None;
    }
    let buckets = partition / bucket + i64::from(partition % bucket != 0);
    buckets.checked_mul(bucket)
}

/// A label set's id in ClickHouse: the content hash of its labels with its
/// low 32 bits (the first four bytes stored, which order the rows) taken
/// from the hash of its `node` label. Rows are ordered by label set within
/// a bucket or a span, so a node's sets lie together: a query for one node
/// (or a pod or container on it) reads a few granules of each span instead
/// of one per set scattered through all of them (the bench's one node read
/// 36k rollup rows per shard instead of 235k). Sets without a node share
/// one prefix. Ids written before (the plain content hash) stay valid: the
/// same labels under two ids are read as the same labels, and a batch's
/// rows stored under both count once (they share the last 12 bytes: see
/// [`ROW_COPY_KEY`]).
fn clustered_label_set_id(bytes: &mut Vec<u8>, labels: &[(String, String)]) -> u128 {
    let node = labels
        .iter()
        .find(|(name, _)| name == crate::ingest::NODE_LABEL)
        .map_or("", |(_, value)| value.as_str());
    let prefix = xxhash_rust::xxh3::xxh3_64(node.as_bytes()) as u32;
    (label_set_hash(bytes, labels) & !u128::from(u32::MAX)) | u128::from(prefix)
}

/// The newest deleted bucket from the rows of `retention` (their count and
/// largest mark): `i64::MIN` when none was.
fn retention_mark(rows: u64, last_bucket: i64) -> i64 {
    if rows > 0 { last_bucket } else { i64::MIN }
}

/// What a sum of sample rows depends on besides them (see
/// `summed_sample_rows`): the batches tried more than once in its range
/// (how many, and a checksum) and the retention mark.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Retried {
    batches: u64,
    checksum: u64,
    retention_mark: i64,
}

/// The columns of a try's row in `attempts`.
const ATTEMPT_COLUMNS: &str = "batch, bucket, at_unix_nanos";

/// A try's row in `attempts`, begun now.
fn attempt_row(batch: u128, bucket: i64) -> bytes::Bytes {
    let mut row = RowWriter::default();
    row.hash(batch);
    row.i64(bucket);
    row.i64(unix_nanos(SystemTime::now()));
    row.bytes.into()
}

/// What names a sample row's copies (the rows of one batch stored twice),
/// for `GROUP BY`: its key, with its label set by the 12 bytes its id
/// shares with the id a former collector gave it (see
/// `clustered_label_set_id`), so a batch first tried by one and retried by
/// the other still counts once.
const ROW_COPY_KEY: &str = "bucket, substring(label_set, 5, 12), stack, batch, sample_period";

/// Sums taken before every row of the range is merged: the first assuming
/// no batch was retried, then again each time the retried ones or the
/// retention mark were not what the sums assumed.
const SUM_TRIES: usize = 4;

/// The columns of `exact_sum`, in its order.
const WEIGHT_PARTS: &str = "sum(bitAnd(weight, 2097151)), \
     sum(bitAnd(bitShiftRight(weight, 21), 2097151)), sum(bitShiftRight(weight, 42))";

/// Reads the columns of `WEIGHT_PARTS`.
fn read_sum(r: &mut RowReader<'_>) -> Result<u128, String> {
    Ok(exact_sum([r.u64()?, r.u64()?, r.u64()?]))
}

/// What a sum is grouped by.
#[derive(Debug, Clone, Copy)]
enum SumKey {
    /// Per stack: a flamegraph.
    Stack,
    /// Per bucket, for a series of points `step_nanos` wide (one per bucket
    /// when not positive).
    Bucket { step_nanos: i64 },
}

impl SumKey {
    fn sample_column(self) -> &'static str {
        match self {
            Self::Stack => "stack",
            Self::Bucket { .. } => "bucket",
        }
    }

    /// The column and table of rollups that sum the same.
    fn rollup_column_and_table(self) -> (&'static str, &'static str) {
        match self {
            Self::Stack => ("stack", "rollups"),
            Self::Bucket { .. } => ("span_start", "rollup_sets"),
        }
    }

    /// The span widths that can answer: for a series, spans each wholly
    /// inside one point.
    fn widths(self, tiers: &Tiers, bucket_nanos: i64) -> Vec<i64> {
        match self {
            Self::Stack => tiers.widths().to_vec(),
            Self::Bucket { step_nanos } => {
                super::tiers::fitting(tiers.widths(), super::point_width(step_nanos, bucket_nanos))
            }
        }
    }
}

/// The conditions on label sets that select a query's rows: one sum per
/// condition, added up.
struct LabelConditions {
    rollups: Vec<String>,
    samples: Vec<String>,
}

impl ClickhouseStorage {
    /// Connects, creates the database and tables on every server if
    /// missing, and checks that stored data was written with these
    /// settings.
    pub fn open(
        config: ClickhouseConfig,
        mut options: ClickhouseOptions,
    ) -> Result<Self, StorageError> {
        options.partition_nanos = partition_width(options.bucket_nanos, options.partition_nanos)
            .ok_or_else(|| {
                StorageError::InvalidOptions(format!(
                    "bucket_nanos and partition_nanos must be positive (and the partition, \
                     rounded up to whole buckets, fit in 64 bits), got {} and {}",
                    options.bucket_nanos, options.partition_nanos
                ))
            })?;
        if config.servers.is_empty() {
            return Err(StorageError::InvalidOptions("no ClickHouse server".into()));
        }
        let client = Client::new(
            options.connect_timeout,
            options.request_timeout,
            options.max_response_bytes,
        )
        .map_err(|source| StorageError::Remote {
            action: "building the HTTP client".into(),
            source,
        })?;
        let endpoints: Vec<Endpoint> = config
            .servers
            .iter()
            .map(|url| Endpoint {
                url: url.clone(),
                user: config.user.clone(),
                password: config.password.clone(),
            })
            .collect();
        let mut by_address: Vec<usize> = (0..endpoints.len()).collect();
        by_address.sort_by(|&a, &b| endpoints[a].url.cmp(&endpoints[b].url));
        let tables = Tables {
            database: config.database.clone(),
            distributed: config.cluster.is_some(),
        };
        let batch_ids = batch_ids::BatchIdWriter::start(
            client.clone(),
            endpoints.clone(),
            tables.local("batches"),
            options.batch_id_linger,
            options.max_queued_batch_ids,
        )
        .map_err(|err| StorageError::Remote {
            action: "starting the thread that writes batch ids".into(),
            source: Box::new(err),
        })?;
        let storage = Self {
            tables,
            batch_ids,
            stored_stacks: Mutex::new(BoundedSet::new(options.cache_entries)),
            stored_label_sets: Mutex::new(BoundedSet::new(options.cache_entries)),
            query_caches: Mutex::new(QueryCaches {
                label_sets: BoundedMap::new(options.query_cache_entries),
                stacks: BoundedMap::new(options.query_cache_entries),
                locations: BoundedMap::new(options.query_cache_entries),
            }),
            endpoints,
            by_address,
            client,
            tiers: Tiers::new(options.bucket_nanos),
            config,
            options,
            merged_sums: Default::default(),
            rollup_spans_read: Default::default(),
        };
        for endpoint in &storage.endpoints {
            storage.init_server(endpoint)?;
        }
        Ok(storage)
    }

    pub fn config(&self) -> &ClickhouseConfig {
        &self.config
    }

    /// Writes the batch ids still queued behind ingest now, and waits for
    /// those being written (see `batch_ids`): another collector then finds
    /// them. Compaction, retention and dropping the storage do it first.
    pub fn flush_batch_ids(&self) {
        self.batch_ids.flush();
    }

    fn init_server(&self, endpoint: &Endpoint) -> Result<(), StorageError> {
        let at = |what: &str| format!("{what} on {}", endpoint.url);
        if let Some(cluster) = &self.config.cluster {
            let answer = self
                .client
                .query(
                    endpoint,
                    &format!(
                        "SELECT count() FROM system.clusters WHERE cluster = '{cluster}' \
                         FORMAT RowBinary"
                    ),
                )
                .map_err(remote(at("looking up the cluster")))?;
            let hosts = self.decode(endpoint, &answer, |r| r.u64())?;
            if hosts.first().copied().unwrap_or(0) == 0 {
                return Err(StorageError::InvalidOptions(format!(
                    "{} has no cluster {cluster:?} in its remote_servers configuration",
                    endpoint.url
                )));
            }
        }
        // The database and `meta` first: the settings are checked before
        // any table is made with them.
        let statements = schema::create_statements(
            &self.tables,
            self.config.cluster.as_deref(),
            self.options.partition_nanos,
        );
        let (settings, tables) = statements.split_at(schema::SETTINGS_STATEMENTS);
        let create = |statements: &[String]| {
            statements.iter().try_for_each(|statement| {
                self.client
                    .execute(endpoint, statement)
                    .map_err(remote(at("creating the schema")))
            })
        };
        create(settings)?;
        let meta = self.tables.own("meta");
        let answer = self
            .client
            .query(
                endpoint,
                &format!("SELECT key, value FROM {meta} FINAL FORMAT RowBinary"),
            )
            .map_err(remote(at("reading meta")))?;
        let stored: BTreeMap<String, i64> = self
            .decode(endpoint, &answer, |r| Ok((r.string()?, r.i64()?)))?
            .into_iter()
            .collect();
        let wanted = [
            ("schema_version", SCHEMA_VERSION),
            ("bucket_nanos", self.options.bucket_nanos),
            ("partition_nanos", self.options.partition_nanos),
        ];
        let incompatible = |reason: String| StorageError::Incompatible {
            path: format!("{}{}", endpoint.url, self.config.database).into(),
            reason,
        };
        // Two collectors creating the same database at once with different
        // settings both write theirs; `FINAL` keeps one, and the other
        // collector is refused when it next opens the database. Collectors
        // of one fleet are started with one configuration.
        // How the database was created: `cluster=NAME` (or `cluster=` for
        // a single server) = 1. A collector pointed at one shard without
        // `?cluster=` would read and write that shard alone. Databases
        // created before this key existed are not checked.
        let cluster_key = format!("cluster={}", self.config.cluster.as_deref().unwrap_or(""));
        if stored.is_empty() {
            create(tables)?;
            let mut rows = RowWriter::default();
            for (key, value) in wanted {
                rows.string(key.as_bytes());
                rows.i64(value);
            }
            rows.string(cluster_key.as_bytes());
            rows.i64(1);
            return self
                .client
                .insert(endpoint, &meta, "key, value", rows.bytes.into())
                .map_err(remote(at("writing meta")));
        }
        if let Some(created) = stored.keys().find(|key| key.starts_with("cluster="))
            && *created != cluster_key
        {
            let how = |key: &str| match &key["cluster=".len()..] {
                "" => "a single server (no ?cluster=)".to_owned(),
                name => format!("cluster {name:?} (?cluster={name})"),
            };
            return Err(incompatible(format!(
                "it was created for {}, not for {} as asked; list every shard with \
                 ?cluster=NAME, as when it was created",
                how(created),
                how(&cluster_key)
            )));
        }
        let mut upgrade_from = None;
        for (key, value) in wanted {
            match stored.get(key) {
                Some(&stored) if stored == value => {}
                Some(&stored) if key == "schema_version" && stored > value => {
                    return Err(incompatible(format!(
                        "its schema version {stored} is newer than the {value} this collector \
                         knows; run a newer collector"
                    )));
                }
                Some(&stored) if key == "schema_version" => upgrade_from = Some(stored),
                Some(&stored) => {
                    return Err(incompatible(format!(
                        "it was created with {key} = {stored}, not the {value} asked for; a \
                         database keeps the settings it was created with"
                    )));
                }
                None => return Err(StorageError::Corrupt(format!("meta has no {key}"))),
            }
        }
        create(tables)?;
        if let Some(from) = upgrade_from {
            self.upgrade_server(endpoint, from)?;
        }
        Ok(())
    }

    /// Brings one server's tables, written by schema version `from`, up to
    /// date, then writes the version (`meta` keeps the row written last).
    /// Collectors of the older version must be stopped first: they would
    /// go on writing the old way.
    fn upgrade_server(&self, endpoint: &Endpoint, from: i64) -> Result<(), StorageError> {
        let at = |what: &str| format!("{what} on {}", endpoint.url);
        tracing::info!(server = %endpoint.url, "upgrading the schema from version {from} to {SCHEMA_VERSION}");
        // Version 2's `attempts` had no time: its tries count as old (0).
        let mut attempts = vec!["attempts_local"];
        if self.tables.distributed {
            attempts.push("attempts");
        }
        for table in attempts {
            let sql = format!(
                "SELECT count() FROM system.columns WHERE database = '{}' AND table = '{table}' \
                 AND name = 'at_unix_nanos' FORMAT RowBinary",
                self.config.database
            );
            let answer = self
                .client
                .query(endpoint, &sql)
                .map_err(remote(at("reading the columns of attempts")))?;
            if self.decode(endpoint, &answer, |r| r.u64())?.first() == Some(&0) {
                let sql = format!(
                    "ALTER TABLE {}.{table} ADD COLUMN at_unix_nanos Int64 DEFAULT 0",
                    self.config.database
                );
                self.client
                    .execute(endpoint, &sql)
                    .map_err(remote(at("adding the time of tries")))?;
            }
        }
        // Only a partition of several parts can hold a copy not merged
        // away; one statement each, so none reads the whole table.
        let sql = format!(
            "SELECT partition FROM system.parts WHERE database = '{}' \
             AND table = 'samples_local' AND active \
             GROUP BY partition HAVING count() > 1 FORMAT RowBinary",
            self.config.database
        );
        let answer = self
            .client
            .query(endpoint, &sql)
            .map_err(remote(at("listing partitions")))?;
        let partitions: Vec<i64> = self
            .decode(endpoint, &answer, |r| r.string())?
            .iter()
            .filter_map(|partition| partition.parse().ok())
            .collect();
        for statement in schema::upgrade_statements(
            &self.tables,
            from,
            &partitions,
            self.options.partition_nanos,
        ) {
            self.client
                .execute(endpoint, &statement)
                .map_err(remote(at("upgrading the schema")))?;
        }
        let mut row = RowWriter::default();
        row.string(b"schema_version");
        row.i64(SCHEMA_VERSION);
        self.client
            .insert(
                endpoint,
                &self.tables.own("meta"),
                "key, value",
                row.bytes.into(),
            )
            .map_err(remote(at("writing the schema version")))
    }

    /// Decodes every row of a RowBinary answer with `row`.
    fn decode<T>(
        &self,
        endpoint: &Endpoint,
        answer: &[u8],
        mut row: impl FnMut(&mut RowReader<'_>) -> Result<T, String>,
    ) -> Result<Vec<T>, StorageError> {
        let mut reader = RowReader::new(answer);
        let mut rows = Vec::new();
        while !reader.is_empty() {
            rows.push(row(&mut reader).map_err(|message| StorageError::Remote {
                action: "reading an answer".into(),
                source: Box::new(ClickhouseError::Decode {
                    endpoint: endpoint.url.clone(),
                    message,
                }),
            })?);
        }
        Ok(rows)
    }

    /// Runs `attempt` against the first server that can be reached: a
    /// server that is down is skipped; one that refuses the statement is
    /// not (another would refuse it too), nor one that timed out (another
    /// would run the same heavy statement again). Every statement sent
    /// this way is safe to repeat.
    fn any_server<T>(
        &self,
        action: &str,
        attempt: impl FnMut(&Endpoint) -> Result<T, ClickhouseError>,
    ) -> Result<T, StorageError> {
        self.first_server(action, ClickhouseError::fails_over, attempt)
    }

    /// Runs a statement that must not run twice (a build's `INSERT ..
    /// SELECT`): on the first server that accepts a connection, never sent
    /// again after it reached one.
    fn execute_once(&self, action: &str, sql: &str) -> Result<(), StorageError> {
        self.first_server(action, ClickhouseError::never_sent, |endpoint| {
            self.client.execute(endpoint, sql)
        })
    }

    /// Runs `attempt` on each server in turn until one succeeds or fails
    /// with an error `fails_over` does not pass on to the next.
    fn first_server<T>(
        &self,
        action: &str,
        fails_over: fn(&ClickhouseError) -> bool,
        mut attempt: impl FnMut(&Endpoint) -> Result<T, ClickhouseError>,
    ) -> Result<T, StorageError> {
        let mut last = None;
        for endpoint in &self.endpoints {
            match attempt(endpoint) {
                Ok(value) => return Ok(value),
                Err(err) if fails_over(&err) => {
                    tracing::warn!(server = %endpoint.url, "{action}: {err}; trying the next server");
                    last = Some(err);
                }
                Err(err) => return Err(remote(action)(err)),
            }
        }
        Err(remote(action)(last.unwrap_or(ClickhouseError::Decode {
            endpoint: String::new(),
            message: "no server".into(),
        })))
    }

    /// Runs a RowBinary query on a server that answers and decodes its rows.
    fn select<T>(
        &self,
        action: &str,
        sql: &str,
        mut row: impl FnMut(&mut RowReader<'_>) -> Result<T, String>,
    ) -> Result<Vec<T>, StorageError> {
        let (endpoint, answer) = self.any_server(action, |endpoint| {
            self.client
                .query(endpoint, sql)
                .map(|answer| (endpoint.clone(), answer))
        })?;
        self.decode(&endpoint, &answer, &mut row)
    }

    fn insert(
        &self,
        action: &str,
        table: &str,
        columns: &str,
        rows: RowWriter,
    ) -> Result<(), StorageError> {
        if rows.bytes.is_empty() {
            return Ok(());
        }
        let rows = bytes::Bytes::from(rows.bytes);
        self.any_server(action, |endpoint| {
            self.client
                .insert(endpoint, &self.tables.table(table), columns, rows.clone())
        })
    }

    /// Stores a batch's new stacks and label sets (through the
    /// `Distributed` tables: each row on the shard its hash picks, where
    /// its copies collapse); returns the sample rows. Before the samples:
    /// a sample is never visible before what it references. Each insert
    /// returns once every shard has its rows.
    fn store_dictionaries(
        &self,
        batch: &ValidBatch,
        bucket: i64,
    ) -> Result<RowWriter, StorageError> {
        let rows = self.batch_rows(batch, bucket)?;
        self.insert(
            "storing stacks",
            "stacks",
            "stack, bucket, frames",
            rows.stacks,
        )?;
        self.insert(
            "storing label sets",
            "label_sets",
            "label_set, bucket, label_names, label_values",
            rows.label_sets,
        )?;
        {
            let mut stored = lock(&self.stored_stacks);
            for entry in rows.new_stacks {
                stored.insert(entry);
            }
        }
        {
            let mut stored = lock(&self.stored_label_sets);
            for entry in rows.new_label_sets {
                stored.insert(entry);
            }
        }
        Ok(rows.samples)
    }

    /// The servers a batch's rows go to, in the order they are tried: its
    /// home shard first (picked by a hash of its id among the servers
    /// sorted by address, so every collector picks the same one whatever
    /// order its URL lists them in), then the others; each by its index in
    /// `endpoints`.
    fn batch_servers(&self, id: u128) -> impl Iterator<Item = usize> + '_ {
        let home =
            (xxhash_rust::xxh3::xxh3_64(&id.to_le_bytes()) % self.by_address.len() as u64) as usize;
        let (from_home, before_home) = (&self.by_address[home..], &self.by_address[..home]);
        from_home.iter().chain(before_home).copied()
    }

    /// Registers a try at storing batch `id`'s samples in `bucket` on
    /// `endpoint`'s own `attempts`, timed now: before its samples, so no
    /// read sums them without knowing of it.
    fn register_try(
        &self,
        endpoint: &Endpoint,
        id: u128,
        bucket: i64,
    ) -> Result<(), ClickhouseError> {
        self.client.insert(
            endpoint,
            &self.tables.local("attempts"),
            ATTEMPT_COLUMNS,
            attempt_row(id, bucket),
        )
    }

    /// Stores a batch's samples on the own tables of `endpoints[server]`
    /// (its try registered there), then queues its id for them (see
    /// `batch_ids`; written here when the queue is full): the id after,
    /// so a batch that failed half-way is stored again on retry. A
    /// failure says what failed.
    fn store_batch_on(
        &self,
        server: usize,
        id: u128,
        samples: &bytes::Bytes,
        id_row: &bytes::Bytes,
    ) -> Result<(), (&'static str, ClickhouseError)> {
        let endpoint = &self.endpoints[server];
        if !samples.is_empty() {
            self.client
                .insert(
                    endpoint,
                    &self.tables.local("samples"),
                    "bucket, label_set, stack, batch, sample_period, weight",
                    samples.clone(),
                )
                .map_err(|err| ("storing samples", err))?;
        }
        match self.batch_ids.queue(server, id, id_row.clone()) {
            Ok(()) => Ok(()),
            Err(id_row) => self
                .client
                .insert(
                    endpoint,
                    &self.tables.local("batches"),
                    batch_ids::BATCH_COLUMNS,
                    id_row,
                )
                .map_err(|err| ("storing the batch id", err)),
        }
    }

    fn bucket_of(&self, unix_nanos: i64) -> i64 {
        unix_nanos.saturating_sub(unix_nanos.rem_euclid(self.options.bucket_nanos))
    }

    fn partition_of(&self, bucket: i64) -> i64 {
        // intDiv in ClickHouse rounds toward zero, as `/` does.
        bucket / self.options.partition_nanos
    }

    /// The newest deleted bucket (`i64::MIN` when none was).
    fn retention_mark(&self) -> Result<i64, StorageError> {
        let sql = format!(
            "SELECT count(), max(last_bucket) FROM {} FORMAT RowBinary",
            self.tables.own("retention")
        );
        let rows = self.select("reading the retention mark", &sql, |r| {
            Ok((r.u64()?, r.i64()?))
        })?;
        Ok(rows
            .first()
            .map_or(i64::MIN, |&(count, last)| retention_mark(count, last)))
    }

    /// How a selection's buckets are read: rollups of the given widths and
    /// the sample rows between them, for the buckets that overlap its range
    /// and were not deleted; `None` when it reads no bucket.
    fn selection_cover(
        &self,
        selection: &Selection,
        widths: &[i64],
    ) -> Result<Option<Cover>, StorageError> {
        let range = selection.range;
        if range.start_unix_nanos >= range.end_unix_nanos {
            return Ok(None);
        }
        let mark = self.retention_mark()?;
        // Bucket b covers [b, b + width): it overlaps [start, end) iff
        // b < end and b > start - width.
        let lo = range
            .start_unix_nanos
            .saturating_sub(self.options.bucket_nanos)
            .max(mark);
        let hi = range.end_unix_nanos;
        if lo >= hi {
            return Ok(None);
        }
        let mut cover = self.cover(lo, hi, widths)?;
        cover.retention_mark = mark;
        Ok(Some(cover))
    }

    /// Labels of the given label sets, from the cache or the database.
    fn labels_of(&self, hashes: &BTreeSet<u128>) -> Result<HashMap<u128, Labels>, StorageError> {
        let mut found = HashMap::with_capacity(hashes.len());
        let mut missing = Vec::new();
        {
            let caches = lock(&self.query_caches);
            for &hash in hashes {
                match caches.label_sets.entries.get(&hash) {
                    Some(labels) => {
                        found.insert(hash, Arc::clone(labels));
                    }
                    None => missing.push(hash),
                }
            }
        }
        for chunk in missing.chunks(self.options.stack_fetch_chunk.max(1)) {
            // One `any` of the pair: two would each pick a row of their own.
            let sql = format!(
                "SELECT label_set, any((label_names, label_values)) FROM {} \
                 WHERE label_set IN ({}) GROUP BY label_set FORMAT RowBinary",
                self.tables.table("label_sets"),
                hash_list(chunk.iter().copied())
            );
            let rows = self.select("reading label sets", &sql, |r| {
                Ok((r.hash()?, r.strings()?, r.strings()?))
            })?;
            let mut caches = lock(&self.query_caches);
            for (hash, names, values) in rows {
                if names.len() != values.len() {
                    return Err(StorageError::Corrupt(format!(
                        "label set {hash:032x} has {} names and {} values",
                        names.len(),
                        values.len()
                    )));
                }
                let mut labels: Vec<(String, String)> = names.into_iter().zip(values).collect();
                // As SQLite reads them: by name, the first of a name kept.
                labels.sort_by(|a, b| a.0.cmp(&b.0));
                labels.dedup_by(|next, kept| next.0 == kept.0);
                let labels: Labels = labels.into();
                caches.label_sets.insert(hash, Arc::clone(&labels));
                found.insert(hash, labels);
            }
        }
        if let Some(hash) = hashes.iter().find(|hash| !found.contains_key(hash)) {
            return Err(StorageError::Corrupt(format!(
                "samples reference label set {hash:032x}, which does not exist"
            )));
        }
        Ok(found)
    }

    /// Label sets with samples in a cover's spans and gaps, and their
    /// labels. Without `FINAL`: a duplicate row names the same label set.
    fn label_sets_in(&self, cover: &Cover) -> Result<HashMap<u128, Labels>, StorageError> {
        let in_spans = cover.spans_condition().map(|spans| {
            format!(
                "SELECT label_set FROM {} WHERE {spans} AND label_set != {} \
                 GROUP BY label_set FORMAT RowBinary",
                self.tables.table("rollup_sets"),
                hash_list([rollup::EVERY_CPU])
            )
        });
        let in_gaps = cover.gaps_condition().map(|gaps| {
            format!(
                "SELECT label_set FROM {} WHERE {gaps} GROUP BY label_set FORMAT RowBinary",
                self.tables.table("samples")
            )
        });
        let find = |sql: Option<String>| match sql {
            Some(sql) => self.select("finding label sets", &sql, |r| r.hash()),
            None => Ok(Vec::new()),
        };
        let (in_spans, in_gaps) = both(|| find(in_spans), || find(in_gaps));
        let hashes: BTreeSet<u128> = in_spans?.into_iter().chain(in_gaps?).collect();
        self.labels_of(&hashes)
    }

    /// The label sets in a cover that the selection's matchers select.
    fn selected_label_sets(
        &self,
        selection: &Selection,
        cover: &Cover,
    ) -> Result<BTreeMap<u128, Labels>, StorageError> {
        Ok(self
            .label_sets_in(cover)?
            .into_iter()
            .filter(|(_, labels)| {
                selection.matches_labels(labels.iter().map(|(n, v)| (n.as_str(), v.as_str())))
            })
            .collect())
    }

    /// The conditions on label sets that select a selection's rows, of
    /// rollups or of samples; none when it selects nothing. The selected
    /// sets are named in chunks of `stack_fetch_chunk`, one condition each
    /// (a single `IN` list of tens of thousands would pass the server's
    /// `max_ast_elements`); each condition selects other rows, so answers
    /// add up over them.
    fn label_conditions(
        &self,
        selection: &Selection,
        cover: &Cover,
    ) -> Result<LabelConditions, StorageError> {
        if selection.selects_every_cpu_sample() {
            // Rollups sum every CPU set under one; the sample rows are
            // every set's but those of other profile types, which carry the
            // type's label: the one subquery runs once, where the query
            // starts (GLOBAL), and finds none on most stores.
            return Ok(LabelConditions {
                rollups: vec![format!("label_set = {}", hash_list([rollup::EVERY_CPU]))],
                samples: vec![format!(
                    "label_set GLOBAL NOT IN \
                     (SELECT label_set FROM {} WHERE has(label_names, '{PROFILE_TYPE_LABEL}'))",
                    self.tables.table("label_sets")
                )],
            });
        }
        let selected: Vec<u128> = self
            .selected_label_sets(selection, cover)?
            .into_keys()
            .collect();
        let sets: Vec<String> = selected
            .chunks(self.options.stack_fetch_chunk.max(1))
            .map(|chunk| format!("label_set IN ({})", hash_list(chunk.iter().copied())))
            .collect();
        Ok(LabelConditions {
            rollups: sets.clone(),
            samples: sets,
        })
    }

    /// Frames of the given stacks, from the cache or the database.
    fn frames_of(&self, hashes: &[u128]) -> Result<HashMap<u128, Frames>, StorageError> {
        let mut found = HashMap::with_capacity(hashes.len());
        let mut missing = Vec::new();
        {
            let caches = lock(&self.query_caches);
            for &hash in hashes {
                match caches.stacks.entries.get(&hash) {
                    Some(frames) => {
                        found.insert(hash, Arc::clone(frames));
                    }
                    None => missing.push(hash),
                }
            }
        }
        for chunk in missing.chunks(self.options.stack_fetch_chunk.max(1)) {
            let sql = format!(
                "SELECT stack, any(frames) FROM {} WHERE stack IN ({}) GROUP BY stack \
                 FORMAT RowBinary",
                self.tables.table("stacks"),
                hash_list(chunk.iter().copied())
            );
            let rows = self.select("reading stacks", &sql, |r| {
                Ok((r.hash()?, r.bytes()?.to_vec()))
            })?;
            let mut caches = lock(&self.query_caches);
            for (hash, blob) in rows {
                let locations = codec::decode_stack(&blob).map_err(|err| {
                    StorageError::Corrupt(format!("stack {hash:032x}: frames blob: {err}"))
                })?;
                let mut frames = Vec::new();
                for location in locations {
                    let key = xxhash_rust::xxh3::xxh3_128(location.raw);
                    let resolved = match caches.locations.entries.get(&key) {
                        Some(resolved) => Arc::clone(resolved),
                        None => {
                            let resolved: Frames =
                                resolve_frames(&location.mapping, location.address, location.lines)
                                    .into();
                            caches.locations.insert(key, Arc::clone(&resolved));
                            resolved
                        }
                    };
                    frames.extend(resolved.iter().cloned());
                }
                let frames: Frames = frames.into();
                caches.stacks.insert(hash, Arc::clone(&frames));
                found.insert(hash, frames);
            }
        }
        if let Some(hash) = hashes.iter().find(|hash| !found.contains_key(hash)) {
            return Err(StorageError::Corrupt(format!(
                "samples reference stack {hash:032x}, which does not exist"
            )));
        }
        Ok(found)
    }
}

/// What a batch adds, ready to insert.
struct BatchRows {
    stacks: RowWriter,
    label_sets: RowWriter,
    samples: RowWriter,
    /// (hash, partition) written, for the caches once stored (and to write
    /// each once per batch).
    new_stacks: HashSet<(u128, i64)>,
    new_label_sets: HashSet<(u128, i64)>,
}

impl ClickhouseStorage {
    /// Refuses a batch whose new dictionary rows pass
    /// `max_batch_dictionary_bytes` (checked as they are built, so no more
    /// than that and one row is ever held).
    fn check_dictionary_bytes(&self, rows: &BatchRows) -> Result<(), StorageError> {
        let bytes = rows.stacks.bytes.len() + rows.label_sets.bytes.len();
        let limit = self.options.max_batch_dictionary_bytes;
        if bytes > limit {
            return Err(StorageError::TooLarge(format!(
                "its new stacks and label sets take more than {limit} bytes as ClickHouse \
                 rows (max_batch_dictionary_bytes); send smaller batches"
            )));
        }
        Ok(())
    }

    fn batch_rows(&self, batch: &ValidBatch, bucket: i64) -> Result<BatchRows, StorageError> {
        let invalid = StorageError::InvalidBatch;
        let partition = self.partition_of(bucket);
        let mut bytes = Vec::new();
        let mapping_hashes: Vec<u128> = batch
            .mappings
            .iter()
            .map(|m| mapping_hash(&mut bytes, m))
            .collect();
        let mut location_hashes = Vec::with_capacity(batch.locations.len());
        for (index, location) in batch.locations.iter().enumerate() {
            let mapping = usize::try_from(location.mapping)
                .ok()
                .and_then(|m| mapping_hashes.get(m))
                .ok_or_else(|| {
                    invalid(format!(
                        "location {index}: mapping {} out of range ({} items)",
                        location.mapping,
                        mapping_hashes.len()
                    ))
                })?;
            location_hashes.push(location_hash(
                &mut bytes,
                *mapping,
                location.address,
                &location.lines,
            ));
        }

        let mut rows = BatchRows {
            stacks: RowWriter::default(),
            label_sets: RowWriter::default(),
            samples: RowWriter::default(),
            new_stacks: HashSet::new(),
            new_label_sets: HashSet::new(),
        };
        let (mut blob, mut scratch) = (Vec::new(), Vec::new());
        let mut stack_hashes = Vec::with_capacity(batch.stacks.len());
        {
            // Locked per lookup: no other ingest waits while blobs encode.
            let stored = |key: &(u128, i64)| lock(&self.stored_stacks).entries.contains(key);
            for (index, stack) in batch.stacks.iter().enumerate() {
                let hash = stack_hash(
                    &mut bytes,
                    stack.iter().map(|&location| {
                        usize::try_from(location)
                            .ok()
                            .and_then(|l| location_hashes.get(l))
                            .copied()
                            .ok_or_else(|| {
                                invalid(format!(
                                    "stack {index}: location {location} out of range ({} items)",
                                    location_hashes.len()
                                ))
                            })
                    }),
                )?;
                stack_hashes.push(hash);
                if stored(&(hash, partition)) || !rows.new_stacks.insert((hash, partition)) {
                    continue;
                }
                codec::encode_stack(batch, stack, &mut blob, &mut scratch)
                    .map_err(|err| invalid(format!("stack {index}: {err}")))?;
                rows.stacks.hash(hash);
                rows.stacks.i64(bucket);
                rows.stacks.string(&blob);
                self.check_dictionary_bytes(&rows)?;
            }
        }

        if batch.label_set_periods.len() != batch.label_sets.len() {
            return Err(invalid(format!(
                "{} label sets but {} periods",
                batch.label_sets.len(),
                batch.label_set_periods.len()
            )));
        }
        let mut label_set_hashes = Vec::with_capacity(batch.label_sets.len());
        {
            let stored = |key: &(u128, i64)| lock(&self.stored_label_sets).entries.contains(key);
            for labels in &batch.label_sets {
                let hash = clustered_label_set_id(&mut bytes, labels);
                label_set_hashes.push(hash);
                if stored(&(hash, partition)) || !rows.new_label_sets.insert((hash, partition)) {
                    continue;
                }
                rows.label_sets.hash(hash);
                rows.label_sets.i64(bucket);
                rows.label_sets
                    .strings(labels.iter().map(|(n, _)| n.as_str()));
                rows.label_sets
                    .strings(labels.iter().map(|(_, v)| v.as_str()));
                self.check_dictionary_bytes(&rows)?;
            }
        }

        // One row per (label set, stack): within a batch, duplicates merge
        // here, capped at i64::MAX (answers are capped there anyway).
        let mut samples: BTreeMap<(u128, u128), (u64, u64)> = BTreeMap::new();
        for (index, sample) in batch.samples.iter().enumerate() {
            let out_of_range = |what: &str, value: u32, len: usize| {
                invalid(format!(
                    "sample {index}: {what} {value} out of range ({len} items)"
                ))
            };
            let stack = usize::try_from(sample.stack)
                .ok()
                .and_then(|s| stack_hashes.get(s))
                .ok_or_else(|| out_of_range("stack", sample.stack, stack_hashes.len()))?;
            let label_set = usize::try_from(sample.label_set)
                .ok()
                .and_then(|s| label_set_hashes.get(s))
                .ok_or_else(|| {
                    out_of_range("label set", sample.label_set, label_set_hashes.len())
                })?;
            if sample.weight == 0 || i64::try_from(sample.weight).is_err() {
                return Err(invalid(format!(
                    "sample {index}: weight {} is not in 1..=i64::MAX",
                    sample.weight
                )));
            }
            // The label set's type decides the period (CPU ticks or
            // nanoseconds off the CPU).
            let period = batch.label_set_periods[sample.label_set as usize];
            let (sum, _) = samples.entry((*label_set, *stack)).or_insert((0, period));
            *sum = sum.saturating_add(sample.weight).min(i64::MAX as u64);
        }
        for ((label_set, stack), (weight, period)) in samples {
            rows.samples.i64(bucket);
            rows.samples.hash(label_set);
            rows.samples.hash(stack);
            rows.samples.hash(u128::from_le_bytes(batch.batch_id));
            rows.samples.u64(period);
            rows.samples.u64(weight);
        }
        Ok(rows)
    }
}

impl ClickhouseStorage {
    /// The selected stacks; `in_units`: each row's weight times its period
    /// (see [`Storage::stacks_in_units`]).
    fn summed_stacks(
        &self,
        selection: &Selection,
        in_units: bool,
    ) -> Result<StackSamples, StorageError> {
        let mut period = PeriodAgreement::default();
        let mut sums: BTreeMap<u128, u128> = BTreeMap::new();
        // Summed per period, so each sum can be scaled by its own.
        for (stack, row_period, sum) in
            self.summed_rows("summing stacks", selection, SumKey::Stack, |r| r.hash())?
        {
            period.add(row_period);
            let sum = if in_units {
                sum.saturating_mul(u128::from(row_period))
            } else {
                sum
            };
            *sums.entry(stack).or_default() += sum;
        }
        let weights: BTreeMap<u128, u64> = sums
            .into_iter()
            .map(|(stack, sum)| (stack, cap(sum)))
            .collect();
        let hashes: Vec<u128> = weights.keys().copied().collect();
        let frames = self.frames_of(&hashes)?;
        let stacks = weights
            .into_iter()
            .filter(|&(_, weight)| weight > 0)
            .map(|(hash, weight)| WeightedStack {
                frames: frames.get(&hash).map(|f| f.to_vec()).unwrap_or_default(),
                weight,
            })
            .collect();
        Ok(StackSamples {
            stacks,
            sample_period_nanos: if in_units { 1 } else { period.result() },
        })
    }

    /// As SQLite's: points aligned to multiples of `step_nanos`, a bucket
    /// overlapping the range counted whole, `step_nanos <= 0` one point per
    /// bucket; `in_units`: each row's weight times its period.
    fn summed_series(
        &self,
        selection: &Selection,
        step_nanos: i64,
        in_units: bool,
    ) -> Result<Vec<(i64, u64)>, StorageError> {
        let mut sums: BTreeMap<i64, u128> = BTreeMap::new();
        for (bucket, row_period, sum) in self.summed_rows(
            "summing the series",
            selection,
            SumKey::Bucket { step_nanos },
            |r| r.i64(),
        )? {
            let sum = if in_units {
                sum.saturating_mul(u128::from(row_period))
            } else {
                sum
            };
            let point = super::series_point(bucket, step_nanos, self.options.bucket_nanos);
            *sums.entry(point).or_default() += sum;
        }
        let points = sums.into_iter().map(|(point, sum)| (point, cap(sum)));
        Ok(points.filter(|&(_, w)| w > 0).collect())
    }

    /// The selected rows' weights summed per `key` and sample period: from
    /// the rollups of the spans that cover the range, and from the sample
    /// rows of the buckets between them.
    fn summed_rows<K: Send>(
        &self,
        action: &str,
        selection: &Selection,
        key: SumKey,
        read_key: impl Fn(&mut RowReader<'_>) -> Result<K, String> + Sync,
    ) -> Result<Vec<(K, u64, u128)>, StorageError> {
        let widths = key.widths(&self.tiers, self.options.bucket_nanos);
        let Some(cover) = self.selection_cover(selection, &widths)? else {
            return Ok(Vec::new());
        };
        let labels = self.label_conditions(selection, &cover)?;
        // The spans' rollups and the gaps' sample rows are read at once.
        let from_rollups = || -> Result<Vec<(K, u64, u128)>, StorageError> {
            let mut rows = Vec::new();
            let Some(spans) = cover.spans_condition() else {
                return Ok(rows);
            };
            self.rollup_spans_read.fetch_add(
                cover.spans.len() as u64,
                std::sync::atomic::Ordering::Relaxed,
            );
            let (column, table) = key.rollup_column_and_table();
            let table = self.tables.table(table);
            for label in &labels.rollups {
                rows.extend(self.select(
                    action,
                    &format!(
                        "SELECT {column}, sample_period, sum(weight0), sum(weight1), \
                         sum(weight2) FROM {table} WHERE {spans} AND {label} \
                         GROUP BY {column}, sample_period FORMAT RowBinary"
                    ),
                    |r| Ok((read_key(r)?, r.u64()?, read_sum(r)?)),
                )?);
            }
            Ok(rows)
        };
        let from_samples = || -> Result<Vec<(K, u64, u128)>, StorageError> {
            let Some(gaps) = cover.gaps_condition() else {
                return Ok(Vec::new());
            };
            let conditions: Vec<String> = labels
                .samples
                .iter()
                .map(|label| format!("{gaps} AND {label}"))
                .collect();
            self.summed_sample_rows(
                action,
                &gaps,
                cover.retention_mark,
                &conditions,
                key.sample_column(),
                &read_key,
            )
        };
        let (from_rollups, from_samples) = both(from_rollups, from_samples);
        let mut rows = from_rollups?;
        rows.extend(from_samples?);
        Ok(rows)
    }

    /// The weights of the sample rows each of `conditions` selects (all in
    /// the buckets `buckets` selects) summed per `key` (a column: `stack`
    /// or `bucket`) and sample period, each batch's rows counted once.
    ///
    /// Rows are summed as they are, but those of batches tried more than
    /// once (see `attempts` in [`schema::local_tables`]), summed apart with
    /// one copy of each row. Those batches are looked up after the sums
    /// (their number and a checksum, with the retention mark): a try that
    /// began meanwhile registered itself before its rows, and `attempts`
    /// only grows but where retention deletes, so if the set and the mark
    /// are the ones the sums assumed, no row they saw came from a try they
    /// did not know of. The first sums assume no retried batch and the
    /// mark the range was bounded by (`retention_mark`; the usual case: a
    /// retry follows a failure), so a range without retried batches takes
    /// one lookup, after its sums, not one before and one after; one with
    /// some, or whose oldest buckets retention deleted meanwhile, is summed
    /// again knowing them. After a few changes, every row of the range is
    /// counted one copy each (grouped by [`ROW_COPY_KEY`], across shards: a
    /// batch's copies may be on two when its home shard could not be
    /// reached once; `FINAL` would merge them only within a shard).
    fn summed_sample_rows<K>(
        &self,
        action: &str,
        buckets: &str,
        retention_mark: i64,
        conditions: &[String],
        key: &str,
        read_key: &impl Fn(&mut RowReader<'_>) -> Result<K, String>,
    ) -> Result<Vec<(K, u64, u128)>, StorageError> {
        if conditions.is_empty() {
            return Ok(Vec::new());
        }
        let samples = self.tables.table("samples");
        let sum_rows =
            |sql: &str| self.select(action, sql, |r| Ok((read_key(r)?, r.u64()?, read_sum(r)?)));
        let retried = self.retried_batches_query(buckets);
        let mut before = Retried {
            batches: 0,
            checksum: 0,
            retention_mark,
        };
        for _ in 0..SUM_TRIES {
            let mut rows = Vec::new();
            for condition in conditions {
                if before.batches == 0 {
                    rows.extend(sum_rows(&format!(
                        "SELECT {key}, sample_period, {WEIGHT_PARTS} FROM {samples} \
                         WHERE {condition} GROUP BY {key}, sample_period FORMAT RowBinary"
                    ))?);
                    continue;
                }
                rows.extend(sum_rows(&format!(
                    "SELECT {key}, sample_period, {WEIGHT_PARTS} FROM {samples} \
                     WHERE {condition} AND batch GLOBAL NOT IN ({retried}) \
                     GROUP BY {key}, sample_period FORMAT RowBinary"
                ))?);
                // A batch's copies are the same rows: one of each.
                rows.extend(sum_rows(&format!(
                    "SELECT {key}, sample_period, {WEIGHT_PARTS} FROM \
                     (SELECT {key}, sample_period, any(weight) AS weight FROM {samples} \
                     WHERE {condition} AND batch GLOBAL IN ({retried}) \
                     GROUP BY {ROW_COPY_KEY}) \
                     GROUP BY {key}, sample_period FORMAT RowBinary"
                ))?);
            }
            let after = self.retried_checksum(&retried)?;
            if after == before {
                return Ok(rows);
            }
            before = after;
        }
        tracing::warn!(
            "{action}: batches kept being retried in the range; every row counted one copy each"
        );
        self.merged_sums
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut rows = Vec::new();
        for condition in conditions {
            rows.extend(sum_rows(&format!(
                "SELECT {key}, sample_period, {WEIGHT_PARTS} FROM \
                 (SELECT {key}, sample_period, any(weight) AS weight FROM {samples} \
                 WHERE {condition} GROUP BY {ROW_COPY_KEY}) \
                 GROUP BY {key}, sample_period FORMAT RowBinary"
            ))?);
        }
        Ok(rows)
    }

    /// How many rollup spans sums read instead of their sample rows.
    pub fn rollup_spans_read(&self) -> u64 {
        self.rollup_spans_read
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How many sums merged every row of their range, because batches
    /// kept being retried in it while they ran.
    pub fn merged_sums(&self) -> u64 {
        self.merged_sums.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The query of the batches tried more than once in the buckets
    /// `buckets` selects.
    fn retried_batches_query(&self, buckets: &str) -> String {
        format!(
            "SELECT batch FROM {} WHERE {buckets} GROUP BY batch HAVING count() > 1",
            self.tables.table("attempts")
        )
    }

    /// How many batches `retried` finds, a checksum of them, and the
    /// retention mark.
    fn retried_checksum(&self, retried: &str) -> Result<Retried, StorageError> {
        let retention = self.tables.own("retention");
        // Current releases make a scalar subquery `Nullable`; 18.16 does not.
        let sql = format!(
            "SELECT count(), sum(sipHash64(batch)), \
             toUInt64(ifNull((SELECT count() FROM {retention}), 0)), \
             toInt64(ifNull((SELECT max(last_bucket) FROM {retention}), 0)) \
             FROM ({retried}) FORMAT RowBinary"
        );
        let rows = self.select("looking up retried batches", &sql, |r| {
            Ok(Retried {
                batches: r.u64()?,
                checksum: r.u64()?,
                retention_mark: retention_mark(r.u64()?, r.i64()?),
            })
        })?;
        rows.first().copied().ok_or_else(|| {
            StorageError::Corrupt("looking up retried batches: no answer row".into())
        })
    }
}

impl Storage for ClickhouseStorage {
    fn bucket_nanos(&self) -> i64 {
        self.options.bucket_nanos
    }

    fn ingest(&self, batch: &ValidBatch) -> Result<IngestOutcome, StorageError> {
        let id = u128::from_le_bytes(batch.batch_id);
        // Partitions are by time: a batch from a clock far ahead would
        // make partitions retention cannot drop for years.
        let latest = unix_nanos(SystemTime::now()).saturating_add(MAX_FUTURE_NANOS);
        if batch.range.end_unix_nanos > latest {
            return Err(StorageError::InvalidBatch(format!(
                "it ends at {} ns since the epoch, more than a day after now; is the node's \
                 clock right?",
                batch.range.end_unix_nanos
            )));
        }
        // Stored by this collector, its id not written yet.
        if self.batch_ids.is_pending(id) {
            return Ok(IngestOutcome::Duplicate);
        }
        let bucket = self.bucket_of(batch.range.start_unix_nanos);
        let mut servers = self.batch_servers(id);
        let home_index = servers.next().expect("open refuses an empty server list");
        let home = &self.endpoints[home_index];
        // The id is looked up on the batch's home shard while its rows are
        // built, its new dictionary rows stored and then its try
        // registered there: for a duplicate, those rows change no answer
        // (dictionary rows are named by their content; a batch tried twice
        // counts once). The try only once the batch is accepted (a refused
        // one registers none) and timed just before its samples go.
        let (seen, stored) = both(
            || {
                let sql = format!(
                    "SELECT count() FROM {} WHERE batch = {} FORMAT RowBinary",
                    self.tables.local("batches"),
                    hash_list([id])
                );
                let answer = self.client.query(home, &sql)?;
                RowReader::new(&answer)
                    .u64()
                    .map_err(|message| ClickhouseError::Decode {
                        endpoint: home.url.clone(),
                        message,
                    })
            },
            || {
                self.store_dictionaries(batch, bucket).map(|samples| {
                    let registered = self.register_try(home, id, bucket);
                    (samples, registered)
                })
            },
        );
        let (samples, registered) = stored?;
        let samples = bytes::Bytes::from(samples.bytes);
        let mut id_row = RowWriter::default();
        id_row.hash(id);
        id_row.i64(unix_nanos(SystemTime::now()));
        id_row.i64(batch.range.end_unix_nanos);
        let id_row = bytes::Bytes::from(id_row.bytes);
        let stored = IngestOutcome::Stored {
            samples: batch.samples.len() as u64,
        };
        let at_home = match (seen, registered) {
            (Ok(seen), _) if seen > 0 => return Ok(IngestOutcome::Duplicate),
            (Err(err), _) => Err(("looking up the batch id", err)),
            (Ok(_), Err(err)) => Err(("registering a try", err)),
            (Ok(_), Ok(())) => self.store_batch_on(home_index, id, &samples, &id_row),
        };
        let mut failed = match at_home {
            Ok(()) => return Ok(stored),
            Err((action, err)) if err.fails_over() => (home, action, err),
            Err((action, err)) => return Err(remote(action)(err)),
        };
        // The home shard cannot be reached: the batch goes to the next
        // that can, unchecked for a duplicate (its home holds the id, and
        // a batch stored twice counts once), its try registered there
        // first, timed now: its rows may land from now on.
        for server in servers {
            let (failed_server, action, err) = &failed;
            tracing::warn!(server = %failed_server.url, "{action}: {err}; trying the next server");
            let endpoint = &self.endpoints[server];
            let result = self
                .register_try(endpoint, id, bucket)
                .map_err(|err| ("registering a try", err))
                .and_then(|()| self.store_batch_on(server, id, &samples, &id_row));
            match result {
                Ok(()) => return Ok(stored),
                Err((action, err)) if err.fails_over() => failed = (endpoint, action, err),
                Err((action, err)) => return Err(remote(action)(err)),
            }
        }
        let (_, action, err) = failed;
        Err(remote(action)(err))
    }

    fn stacks(&self, selection: &Selection) -> Result<StackSamples, StorageError> {
        self.summed_stacks(selection, false)
    }

    fn stacks_in_units(&self, selection: &Selection) -> Result<StackSamples, StorageError> {
        self.summed_stacks(selection, true)
    }

    fn label_names(&self, selection: &Selection) -> Result<Vec<String>, StorageError> {
        let Some(cover) = self.selection_cover(selection, self.tiers.widths())? else {
            return Ok(Vec::new());
        };
        let mut names = BTreeSet::new();
        for labels in self.selected_label_sets(selection, &cover)?.values() {
            names.extend(labels.iter().map(|(name, _)| name.clone()));
        }
        Ok(names.into_iter().collect())
    }

    fn label_values(&self, selection: &Selection, name: &str) -> Result<Vec<String>, StorageError> {
        let Some(cover) = self.selection_cover(selection, self.tiers.widths())? else {
            return Ok(Vec::new());
        };
        let mut values = BTreeSet::new();
        for labels in self.selected_label_sets(selection, &cover)?.values() {
            if let Ok(i) = labels.binary_search_by(|(n, _)| n.as_str().cmp(name)) {
                values.insert(labels[i].1.clone());
            }
        }
        Ok(values.into_iter().collect())
    }

    fn profile_types(&self, selection: &Selection) -> Result<Vec<ProfileType>, StorageError> {
        let Some(cover) = self.selection_cover(selection, self.tiers.widths())? else {
            return Ok(Vec::new());
        };
        let mut types = BTreeSet::new();
        for labels in self.label_sets_in(&cover)?.values() {
            if !selection
                .matches_labels_of_any_type(labels.iter().map(|(n, v)| (n.as_str(), v.as_str())))
            {
                continue;
            }
            let value = labels
                .binary_search_by(|(n, _)| n.as_str().cmp(PROFILE_TYPE_LABEL))
                .map_or("", |i| labels[i].1.as_str());
            types.extend(ProfileType::from_label_value(value));
        }
        Ok(types.into_iter().collect())
    }

    /// As SQLite's: points aligned to multiples of `step_nanos`, a bucket
    /// overlapping the range counted whole, `step_nanos <= 0` one point per
    /// bucket.
    fn series(
        &self,
        selection: &Selection,
        step_nanos: i64,
    ) -> Result<Vec<(i64, u64)>, StorageError> {
        self.summed_series(selection, step_nanos, false)
    }

    fn series_in_units(
        &self,
        selection: &Selection,
        step_nanos: i64,
    ) -> Result<Vec<(i64, u64)>, StorageError> {
        self.summed_series(selection, step_nanos, true)
    }

    /// Hides every bucket ending at or before the cutoff at once (the
    /// retention mark, on every server), then drops the partitions wholly
    /// before it on every server. Returns the sample rows hidden: rows are
    /// per batch, so this counts a (bucket, label set, stack) once per
    /// batch that added to it (SQLite: once), and twice the copies of a
    /// batch stored on two shards (`FINAL` merges within a shard).
    fn delete_before(&self, cutoff_unix_nanos: i64) -> Result<u64, StorageError> {
        // No id this collector queued lands in a partition once dropped (ids
        // are partitioned by when they came: a cutoff near now).
        self.flush_batch_ids();
        let last = cutoff_unix_nanos.saturating_sub(self.options.bucket_nanos);
        let previous = self.retention_mark()?;
        let mut deleted = 0;
        if last > previous {
            let sql = format!(
                "SELECT count() FROM {} FINAL WHERE bucket > {previous} AND bucket <= {last} \
                 FORMAT RowBinary",
                self.tables.table("samples")
            );
            deleted = self
                .select("counting expired samples", &sql, |r| r.u64())?
                .first()
                .copied()
                .unwrap_or(0);
            let mut mark = RowWriter::default();
            mark.i64(last);
            mark.i64(unix_nanos(SystemTime::now()));
            let mark = bytes::Bytes::from(mark.bytes);
            // Every server first: a query anywhere hides the buckets
            // before any partition goes.
            for endpoint in &self.endpoints {
                self.client
                    .insert(
                        endpoint,
                        &self.tables.own("retention"),
                        "last_bucket, at_unix_nanos",
                        mark.clone(),
                    )
                    .map_err(remote(format!(
                        "writing the retention mark on {}",
                        endpoint.url
                    )))?;
            }
        }
        let mark = last.max(previous);
        let mut dropped = false;
        let width = self.options.partition_nanos;
        for endpoint in &self.endpoints {
            let at = |what: &str| format!("{what} on {}", endpoint.url);
            let sql = format!(
                "SELECT DISTINCT table, partition FROM system.parts \
                 WHERE database = '{}' AND active FORMAT RowBinary",
                self.config.database
            );
            let answer = self
                .client
                .query(endpoint, &sql)
                .map_err(remote(at("listing partitions")))?;
            let mut partitions =
                self.decode(endpoint, &answer, |r| Ok((r.string()?, r.string()?)))?;
            // A batch's tries go after its samples: a sum that still reads
            // the buckets must not meet a retried batch's copies without
            // its tries (it would count every copy).
            partitions.sort_by_key(|(table, _)| table == "attempts_local");
            for (table, partition) in partitions {
                let Ok(value) = partition.parse::<i64>() else {
                    continue;
                };
                let droppable = match table.as_str() {
                    // Rollups by their span's start: a span that also
                    // holds later buckets is never read once its start is
                    // deleted.
                    "samples_local" | "stacks_local" | "label_sets_local" | "attempts_local"
                    | "rollups_local" | "rollup_sets_local" | "rollup_spans_local" => {
                        schema::partition_is_before(value, width, mark)
                    }
                    // Keyed by max(received, end): a batch id is kept while
                    // a retry may still come, as SQLite keeps it.
                    "batches_local" => schema::partition_is_before(
                        value,
                        width,
                        cutoff_unix_nanos.saturating_sub(1),
                    ),
                    _ => false,
                };
                if droppable {
                    let sql = format!(
                        "ALTER TABLE {}.{table} DROP PARTITION {value}",
                        self.config.database
                    );
                    self.client
                        .execute(endpoint, &sql)
                        .map_err(remote(at("dropping an expired partition")))?;
                    dropped = true;
                }
            }
        }
        if dropped {
            // The stored-items caches may name partitions that are gone.
            lock(&self.stored_stacks).entries.clear();
            lock(&self.stored_label_sets).entries.clear();
        }
        Ok(deleted)
    }

    /// Builds rollups of closed spans (see `rollup`).
    fn compact(&self, closed_before_unix_nanos: i64) -> Result<u64, StorageError> {
        // This collector's tries are then done, not in flight.
        self.flush_batch_ids();
        self.roll_up(closed_before_unix_nanos)
    }

    /// `None`: the data is on the ClickHouse servers' disks, not this
    /// machine's (`system.parts` there tells how much).
    fn state_sizes(&self, out: &mut Vec<StateSize>) {
        let size = |name, entries: usize, capacity: usize| {
            StateSize::entries(name, entries, Some(capacity))
        };
        if let Ok(stacks) = self.stored_stacks.try_lock() {
            out.push(size("ingest_stacks", stacks.entries.len(), stacks.capacity));
        }
        if let Ok(sets) = self.stored_label_sets.try_lock() {
            out.push(size("ingest_label_sets", sets.entries.len(), sets.capacity));
        }
        let (ids, max_ids) = self.batch_ids.pending();
        out.push(size("ingest_batch_ids", ids, max_ids));
        if let Ok(caches) = self.query_caches.try_lock() {
            for (name, map) in [
                ("query_stacks", &caches.stacks),
                ("query_locations", &caches.locations),
            ] {
                out.push(size(name, map.entries.len(), map.capacity));
            }
            let sets = &caches.label_sets;
            out.push(size("query_label_sets", sets.entries.len(), sets.capacity));
        }
    }

    fn disk_bytes(&self) -> Option<u64> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(url: &str) -> Result<ClickhouseConfig, String> {
        ClickhouseConfig::from_url(url).map_err(|err| err.to_string())
    }

    #[test]
    fn urls() {
        let config = parse("clickhouse://127.0.0.1:8123/stackscope").expect("valid");
        assert_eq!(config.servers, ["http://127.0.0.1:8123/"]);
        assert_eq!(config.database, "stackscope");
        assert_eq!(config.cluster, None);
        let config = parse("clickhouse://u:p@a:1,b/db?cluster=two").expect("valid");
        assert_eq!(config.servers, ["http://a:1/", "http://b:8123/"]);
        assert_eq!(
            (config.user.as_deref(), config.password.as_deref()),
            (Some("u"), Some("p"))
        );
        assert_eq!(config.cluster.as_deref(), Some("two"));
        assert!(format!("{config:?}").contains("\"…\""), "password hidden");

        let tail = "; expected clickhouse://[USER[:PASSWORD]@]HOST:PORT[,HOST:PORT...]/DATABASE[?cluster=NAME]";
        for (url, why) in [
            ("http://a/db", "it does not start with clickhouse://"),
            ("clickhouse://a:8123", "no /DATABASE"),
            ("clickhouse://a:x/db", "port \"x\" of \"a:x\" is not a port"),
            ("clickhouse://a:0/db", "port \"0\" of \"a:0\" is not a port"),
            ("clickhouse://a b:1/db", "\"a b:1\" is not HOST:PORT"),
            (
                "clickhouse://a:1/d-b",
                "database \"d-b\" is not a plain name (letters, digits, _)",
            ),
            (
                "clickhouse://a:1/db?x=1",
                "unknown parameter \"x=1\" (only cluster=NAME)",
            ),
            (
                "clickhouse://a:1/db?cluster=x'y",
                "cluster \"x'y\" is not a plain name",
            ),
            (
                "clickhouse://a:1,b:2/db",
                "several servers need ?cluster=NAME (the remote_servers cluster they form)",
            ),
        ] {
            assert_eq!(
                parse(url).expect_err(url),
                format!("invalid storage options: bad ClickHouse URL {url:?}: {why}{tail}")
            );
        }
        let err = parse("clickhouse://u:secret@a:1/d-b").expect_err("bad");
        assert!(!err.contains("secret"), "{err}");
    }

    #[test]
    fn sums_are_exact_then_capped() {
        let max = i64::MAX as u64;
        let part = |i: u32| (max >> (21 * i)) & 0x1f_ffff;
        // Three rows of i64::MAX: the parts sum them without wrapping.
        let parts = [3 * part(0), 3 * part(1), 3 * part(2)];
        assert_eq!(exact_sum(parts), 3 * u128::from(max));
        assert_eq!(cap(exact_sum(parts)), max);
        // 2^42 rows of i64::MAX: the largest part's sum still fits.
        let parts = [part(0) << 42, part(1) << 42, part(2) << 42];
        assert!(part(0) << 42 < u64::MAX);
        assert_eq!(exact_sum(parts), u128::from(max) << 42);
        assert_eq!(cap(5), 5);
        assert_eq!(cap(u128::from(max) + 1), max);
    }

    #[test]
    fn partitions_are_whole_buckets() {
        let minute = 60_000_000_000;
        let day = 1440 * minute;
        assert_eq!(partition_width(minute, day), Some(day));
        assert_eq!(partition_width(7 * minute, day), Some(1442 * minute));
        assert_eq!(partition_width(2 * day, day), Some(2 * day));
        assert_eq!(partition_width(3, 10), Some(12));
        assert_eq!(partition_width(0, day), None);
        assert_eq!(partition_width(minute, 0), None);
        assert_eq!(partition_width(i64::MAX / 2 + 1, i64::MAX), None);
    }

    #[test]
    fn a_nodes_label_sets_share_the_bytes_that_order_them() {
        let set = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
            pairs
                .iter()
                .map(|&(n, v)| (n.to_owned(), v.to_owned()))
                .collect()
        };
        let id = |pairs: &[(&str, &str)]| clustered_label_set_id(&mut Vec::new(), &set(pairs));
        let a = id(&[("comm", "a"), ("node", "n1")]);
        let b = id(&[("comm", "b"), ("node", "n1"), ("pod", "p")]);
        let c = id(&[("comm", "a"), ("node", "n2")]);
        let first_bytes = |id: u128| id.to_le_bytes()[..4].to_vec();
        assert_eq!(first_bytes(a), first_bytes(b));
        assert_ne!(first_bytes(a), first_bytes(c));
        assert!(a != b && a != c && b != c);
        // The rest is the content hash's.
        let content = label_set_hash(&mut Vec::new(), &set(&[("comm", "a"), ("node", "n1")]));
        assert_eq!(a >> 32, content >> 32);
        assert_ne!(id(&[]), rollup::EVERY_CPU);
    }

    #[test]
    fn hash_literals() {
        assert_eq!(
            hash_list([1u128, u128::MAX]),
            "unhex('01000000000000000000000000000000'),unhex('ffffffffffffffffffffffffffffffff')"
        );
    }
}
