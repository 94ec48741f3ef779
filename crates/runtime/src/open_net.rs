//! The `open` network tier: a veth pair per run, NAT to whatever the host
//! routes, and one nftables table that keeps runs off the host and off each
//! other.
//!
//! Owns the address pool and its allocator, each run's host-side interface
//! and set element, the `inet <table>` nftables table, the host's
//! `net.ipv4.ip_forward` switch, and each run's generated `resolv.conf`.
//! It does not own the run's network namespace ([`crate::oci`] creates and
//! deletes it) and it is not used by the `none` and `allowlist` tiers, whose
//! namespaces have loopback only.
//!
//! Per run, slot `i` of the pool (a /30 each):
//!
//! ```text
//!  host namespace                          /run/netns/runbox-<id>
//!  rbx<last 10 of id> <net>.1/30  <-veth->  eth0 <net>.2/30, default via <net>.1
//!  (alias runbox:<table>:<id>, in @open_ifs)
//! ```
//!
//! The rules, replaced as one transaction whenever an open run is created:
//!
//! ```text
//! table inet <table>
//!   set open_ifs: type ifname           the host side of every open run
//!   input:       iifname @open_ifs ct state established,related  accept
//!                iifname @open_ifs                                drop
//!                  -> a run reaches no address of the host, on any port,
//!                     IPv4 or IPv6 (the API, sshd, anything)
//!   forward:     iifname @open_ifs oifname @open_ifs  drop   (no run to run)
//!   postrouting: ip saddr <pool> oifname != @open_ifs  masquerade
//! ```
//!
//! Setup steps for one run, in order (each undone by teardown):
//! 1. reserve a /30 in memory and write `net.json` in the run directory, so
//!    that a crash from here on leaves a record the sweep finds;
//! 2. turn on `net.ipv4.ip_forward` if it is off (logged: a host setting);
//! 3. create the table if needed and add the host-side name to `open_ifs`,
//!    one nftables transaction; the name is filtered before the link exists;
//! 4. create the veth pair with its run side already in the run's namespace
//!    (one netlink request: no moment with both ends on the host), then
//!    address both ends, bring them up and add the default route;
//! 5. write the run's `resolv.conf` from the host's.
//!
//! Teardown deletes the link (deleting the host side deletes both ends, at
//! once, unlike deleting the namespace, which the kernel finishes later),
//! then the set element. The /30 returns to the pool only when the run
//! directory, and with it `net.json`, is gone.
//!
//! Everything here is host-global (interface names, the table, routes), so
//! one daemon per table and pool: two daemons on a host need their own
//! [`OpenPool`] and table name. Links are marked with their table in their
//! alias so a sweep never touches another daemon's.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::io::Read;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::str::FromStr;
use std::sync::Mutex;
use std::time::Duration;

use runbox_core::lane::LaneError;
use tokio::io::AsyncWriteExt;
use tokio::process::Command;
use ulid::Ulid;

/// The pool open runs take their /30 from unless configured otherwise.
pub const DEFAULT_OPEN_POOL: OpenPool = OpenPool {
    network: Ipv4Addr::new(10, 231, 0, 0),
    prefix_len: 16,
};

/// The nftables table (family `inet`) unless configured otherwise.
pub const DEFAULT_NFT_TABLE: &str = "runbox";

/// The set of host-side interface names in the table.
pub const OPEN_IFS_SET: &str = "open_ifs";

/// The run side's interface name inside the run.
pub const RUN_IFNAME: &str = "eth0";

/// Where the generated resolver configuration appears in an open run.
pub const RESOLV_CONF_PATH: &str = "/etc/resolv.conf";

/// Host-side interface names start with this (the rest is the id's tail).
pub const HOST_IF_PREFIX: &str = "rbx";

/// Characters of the run id in the host-side name: `rbx` + 10 = 13, under
/// the kernel's 15.
const HOST_IF_ID_CHARS: usize = 10;

/// The run's allocation record, in its run directory.
const NET_RECORD: &str = "net.json";

const IP_FORWARD: &str = "/proc/sys/net/ipv4/ip_forward";

/// Resolver configurations read, in order: the host's, then (when the host's
/// names only a local stub such as systemd-resolved's 127.0.0.53) the
/// upstream servers systemd-resolved uses.
const HOST_RESOLV_CONFS: [&str; 2] = ["/etc/resolv.conf", "/run/systemd/resolve/resolv.conf"];

/// The largest host resolv.conf read; real ones are a few hundred bytes.
const MAX_RESOLV_CONF: u64 = 64 * 1024;

/// How long one `ip` or `nft` command may take.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

/// Shortest pool prefix accepted: a /8 already holds four million runs, and
/// anything wider would masquerade most of the address space.
const MIN_POOL_PREFIX: u8 = 8;

/// An IPv4 network that open runs take a /30 each from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpenPool {
    network: Ipv4Addr,
    prefix_len: u8,
}

/// Why an [`OpenPool`] was refused.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// Not `a.b.c.d/len`.
    #[error("invalid pool {0:?}: expected an IPv4 network such as 10.231.0.0/16")]
    Syntax(String),
    /// The prefix is outside /8 to /30.
    #[error("pool prefix /{0} is outside /8 to /30 (each run takes a /30)")]
    Prefix(u8),
    /// Bits set below the prefix.
    #[error("{0}/{1} is not a network address (host bits are set)")]
    HostBits(Ipv4Addr, u8),
}

impl OpenPool {
    /// The pool `network/prefix_len`, with `prefix_len` from 8 to 30 and no
    /// host bits set.
    pub fn new(network: Ipv4Addr, prefix_len: u8) -> Result<OpenPool, PoolError> {
        if !(MIN_POOL_PREFIX..=30).contains(&prefix_len) {
            return Err(PoolError::Prefix(prefix_len));
        }
        let mask = u32::MAX << (32 - prefix_len);
        if u32::from(network) & !mask != 0 {
            return Err(PoolError::HostBits(network, prefix_len));
        }
        Ok(OpenPool {
            network,
            prefix_len,
        })
    }

    /// How many runs fit: one per /30.
    pub fn slots(&self) -> u32 {
        1 << (30 - self.prefix_len)
    }

    /// The `slot`-th /30 of the pool.
    pub fn subnet(&self, slot: u32) -> Option<Subnet> {
        (slot < self.slots()).then(|| Subnet {
            base: Ipv4Addr::from(u32::from(self.network) + slot * 4),
        })
    }
}

impl Default for OpenPool {
    fn default() -> OpenPool {
        DEFAULT_OPEN_POOL
    }
}

impl fmt::Display for OpenPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix_len)
    }
}

impl FromStr for OpenPool {
    type Err = PoolError;

    fn from_str(s: &str) -> Result<OpenPool, PoolError> {
        let syntax = || PoolError::Syntax(s.to_owned());
        let (addr, len) = s.split_once('/').ok_or_else(syntax)?;
        let addr: Ipv4Addr = addr.parse().map_err(|_| syntax())?;
        let len: u8 = len.parse().map_err(|_| syntax())?;
        OpenPool::new(addr, len)
    }
}

/// One run's /30: the host side is `.1`, the run side `.2`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Subnet {
    base: Ipv4Addr,
}

impl Subnet {
    /// The host side's address, the run's gateway.
    pub fn host(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.base) + 1)
    }

    /// The run side's address.
    pub fn run(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.base) + 2)
    }
}

impl fmt::Display for Subnet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/30", self.base)
    }
}

impl FromStr for Subnet {
    type Err = PoolError;

    fn from_str(s: &str) -> Result<Subnet, PoolError> {
        let pool: OpenPool = s.parse()?;
        if pool.prefix_len != 30 {
            return Err(PoolError::Syntax(s.to_owned()));
        }
        Ok(Subnet { base: pool.network })
    }
}

/// The host-side interface name of run `id`: `rbx` and the last ten
/// characters of the id, lowercased (the id's random part).
pub fn host_ifname(id: Ulid) -> String {
    let id = id.to_string();
    format!(
        "{HOST_IF_PREFIX}{}",
        id[id.len() - HOST_IF_ID_CHARS..].to_ascii_lowercase()
    )
}

/// Whether `name` can be an nftables table name here: a letter, then up to
/// 31 letters, digits or underscores (so it is safe in a script and an alias).
pub fn valid_table_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    bytes.next().is_some_and(|b| b.is_ascii_alphabetic())
        && name.len() <= 32
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

fn valid_host_ifname(name: &str) -> bool {
    name.strip_prefix(HOST_IF_PREFIX).is_some_and(|rest| {
        rest.len() == HOST_IF_ID_CHARS
            && rest
                .bytes()
                .all(|b| b.is_ascii_digit() || b.is_ascii_lowercase())
    })
}

/// The alias that marks a host-side link as run `id`'s in `table`.
fn link_alias(table: &str, id: Ulid) -> String {
    format!("runbox:{table}:{id}")
}

/// The table and run of a [`link_alias`].
fn parse_link_alias(alias: &str) -> Option<(&str, Ulid)> {
    let mut parts = alias.split(':');
    if parts.next()? != "runbox" {
        return None;
    }
    let table = parts.next()?;
    let id = Ulid::from_string(parts.next()?).ok()?;
    parts.next().is_none().then_some((table, id))
}

/// What `net.json` records: enough to undo the setup after a crash, even
/// when the daemon restarts with another pool or table.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Allocation {
    subnet: Subnet,
    host_if: String,
    table: String,
}

impl Allocation {
    fn to_json(&self) -> Vec<u8> {
        let value = serde_json::json!({
            "subnet": self.subnet.to_string(),
            "hostIf": self.host_if,
            "table": self.table,
        });
        // A map of strings always serializes.
        serde_json::to_vec_pretty(&value).unwrap_or_default()
    }

    /// Parses and validates a record; names from it reach `ip` and `nft`.
    fn from_json(data: &[u8]) -> Option<Allocation> {
        let value: serde_json::Value = serde_json::from_slice(data).ok()?;
        let field = |name: &str| value.get(name)?.as_str().map(str::to_owned);
        let allocation = Allocation {
            subnet: field("subnet")?.parse().ok()?,
            host_if: field("hostIf")?,
            table: field("table")?,
        };
        (valid_host_ifname(&allocation.host_if) && valid_table_name(&allocation.table))
            .then_some(allocation)
    }
}

/// Which /30 each open run holds. Rebuilt from the run directories at start.
#[derive(Debug, Default)]
struct Allocator {
    runs: BTreeMap<Ulid, Allocation>,
    /// Where the next search starts: slots are handed out round-robin so a
    /// freed address is not reused at once (conntrack entries and late
    /// replies for the old run would reach the new one).
    next: u32,
}

impl Allocator {
    fn reserve(&mut self, pool: &OpenPool, id: Ulid, table: &str) -> Result<Allocation, String> {
        let host_if = host_ifname(id);
        if let Some((other, _)) = self.runs.iter().find(|(_, a)| a.host_if == host_if) {
            // Ten characters of randomness make this all but impossible;
            // refusing keeps one run's teardown from deleting another's link.
            return Err(format!(
                "run {other} already uses interface name {host_if}; retry with another id"
            ));
        }
        let used: HashSet<Subnet> = self.runs.values().map(|a| a.subnet).collect();
        let slots = pool.slots();
        for k in 0..slots {
            let slot = (self.next.wrapping_add(k)) % slots;
            let Some(subnet) = pool.subnet(slot) else {
                continue;
            };
            if used.contains(&subnet) {
                continue;
            }
            self.next = (slot + 1) % slots;
            let allocation = Allocation {
                subnet,
                host_if,
                table: table.to_owned(),
            };
            self.runs.insert(id, allocation.clone());
            return Ok(allocation);
        }
        Err(format!(
            "the open network pool {pool} is full ({slots} runs); configure a larger one"
        ))
    }
}

/// The open tier of one lane: its pool, table and allocations.
pub(crate) struct OpenNet {
    pool: OpenPool,
    table: String,
    /// Why open runs cannot be created here, found once at construction.
    unsupported: Option<String>,
    /// Whether `nft` is installed (without it there is no table to clean).
    nft_present: bool,
    alloc: Mutex<Allocator>,
    /// Serializes changes to the table: a sweep must not delete it between
    /// a create's "make the table" and "add my element".
    nft_lock: tokio::sync::Mutex<()>,
}

impl OpenNet {
    /// Probes the host (is `nft` installed, would it accept the table?) and
    /// loads the allocations recorded under `runs_dir`.
    pub(crate) fn new(pool: OpenPool, table: String, runs_dir: &Path) -> OpenNet {
        let unsupported = probe(&pool, &table);
        if let Some(why) = &unsupported {
            tracing::info!(%why, "the open network tier is not available");
        }
        let net = OpenNet {
            pool,
            table,
            unsupported,
            nft_present: crate::probe::which("nft").is_some(),
            alloc: Mutex::new(Allocator::default()),
            nft_lock: tokio::sync::Mutex::new(()),
        };
        net.load(runs_dir);
        net
    }

    /// Why open runs cannot be created, if they cannot.
    pub(crate) fn unsupported(&self) -> Option<&str> {
        self.unsupported.as_deref()
    }

    /// The /30 run `id` holds, if it is an open run of this lane.
    pub(crate) fn subnet_of(&self, id: Ulid) -> Option<Subnet> {
        self.allocator().runs.get(&id).map(|a| a.subnet)
    }

    fn allocator(&self) -> std::sync::MutexGuard<'_, Allocator> {
        // The allocator is left consistent at every step, so a panic while
        // it was held does not make it unusable.
        self.alloc.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds every allocation recorded in a run directory under `runs_dir`
    /// that the allocator does not know yet.
    fn load(&self, runs_dir: &Path) {
        let Ok(entries) = std::fs::read_dir(runs_dir) else {
            return;
        };
        let mut alloc = self.allocator();
        for entry in entries.flatten() {
            let Some(id) = entry
                .file_name()
                .to_str()
                .and_then(|n| Ulid::from_string(n).ok())
            else {
                continue;
            };
            match read_record(&entry.path()) {
                Ok(Some(allocation)) => {
                    alloc.runs.entry(id).or_insert(allocation);
                }
                Ok(None) => {}
                Err(why) => tracing::error!(run = %id, %why, "unreadable network record"),
            }
        }
    }

    /// Steps 1–5 of the module doc for run `id`, whose directory is
    /// `run_dir` and whose namespace (loopback up) is `netns`. Returns the
    /// host path of the run's resolv.conf.
    ///
    /// On error the caller runs [`OpenNet::teardown`] and, once the run
    /// directory is gone, [`OpenNet::release`].
    pub(crate) async fn setup(
        &self,
        id: Ulid,
        run_dir: &Path,
        netns: &str,
    ) -> Result<PathBuf, LaneError> {
        if let Some(why) = &self.unsupported {
            return Err(LaneError::Unsupported(why.clone()));
        }
        // 1. The address, recorded before anything exists.
        let allocation = self
            .allocator()
            .reserve(&self.pool, id, &self.table)
            .map_err(LaneError::Failed)?;
        write_record(run_dir, &allocation)?;
        // 2. Forwarding.
        enable_forwarding()?;
        // 3. The table and this run's element.
        {
            let _table = self.nft_lock.lock().await;
            let script = format!(
                "{}add element inet {} {OPEN_IFS_SET} {{ \"{}\" }}\n",
                table_script(&self.table, &self.pool),
                self.table,
                allocation.host_if
            );
            nft(&script).await?;
        }
        // 4. The veth pair.
        let Allocation {
            subnet, host_if, ..
        } = &allocation;
        let (host, run) = (subnet.host(), subnet.run());
        ip_batch(
            None,
            &[
                format!("link add {host_if} type veth peer name {RUN_IFNAME} netns {netns}"),
                // No IPv6 link-local addresses: the tier is IPv4 only, so
                // the run gets no IPv6 path at all (the input filter, family
                // inet, would drop IPv6 to the host anyway).
                format!(
                    "link set dev {host_if} alias {} addrgenmode none",
                    link_alias(&self.table, id)
                ),
                format!("address add {host}/30 dev {host_if}"),
                format!("link set dev {host_if} up"),
            ],
        )
        .await?;
        ip_batch(
            Some(netns),
            &[
                format!("link set dev {RUN_IFNAME} addrgenmode none"),
                format!("address add {run}/30 dev {RUN_IFNAME}"),
                format!("link set dev {RUN_IFNAME} up"),
                format!("route add default via {host}"),
            ],
        )
        .await?;
        // 5. Name resolution.
        write_resolv_conf(run_dir)
    }

    /// Undoes [`OpenNet::setup`] for run `id`: deletes its link and its set
    /// element. Does nothing when the run directory has no record (not an
    /// open run, or never seen). Idempotent.
    pub(crate) async fn teardown(&self, id: Ulid, run_dir: &Path) -> Result<(), LaneError> {
        let (host_if, table) = match read_record(run_dir) {
            Ok(Some(a)) => (a.host_if, a.table),
            Ok(None) => return Ok(()),
            // A record exists but cannot be read: fall back to the names
            // this lane would have used.
            Err(why) => {
                tracing::warn!(run = %id, %why, "unreadable network record; using derived names");
                (host_ifname(id), self.table.clone())
            }
        };
        // The link first: while it exists and the element does not, the run
        // side could reach the host unfiltered.
        if let Some(link) = links().await?.into_iter().find(|l| l.name == host_if) {
            let ours = match link.alias.as_deref().and_then(parse_link_alias) {
                Some((t, owner)) => t == table && owner == id,
                // No alias: a crash between creating the link and naming it.
                None => link.alias.as_deref().unwrap_or("").is_empty(),
            };
            if ours {
                delete_link(&link.name).await?;
            } else {
                tracing::warn!(run = %id, link = %link.name, alias = ?link.alias,
                    "not deleting an interface that belongs to something else");
            }
        }
        if !self.nft_present {
            tracing::warn!(run = %id, "nft is not installed; cannot remove the run's set element");
            return Ok(());
        }
        let _table = self.nft_lock.lock().await;
        delete_element(&table, &host_if).await
    }

    /// Undoes [`OpenNet::setup`] entirely while the run directory stays (a
    /// hibernating run): the link and element, then the record, then the
    /// /30. Its next boot sets it up again, maybe on another /30.
    pub(crate) async fn remove(&self, id: Ulid, run_dir: &Path) -> Result<(), LaneError> {
        self.teardown(id, run_dir).await?;
        let path = run_dir.join(NET_RECORD);
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(LaneError::io(format!("removing {}", path.display()))(e)),
        }
        self.release(id);
        Ok(())
    }

    /// Returns run `id`'s /30 to the pool. Called once its run directory
    /// (and so its record) is gone.
    pub(crate) fn release(&self, id: Ulid) {
        self.allocator().runs.remove(&id);
    }

    /// After the lane's sweep destroyed every run not kept: reloads the
    /// allocations of the runs left under `runs_dir`, deletes this table's
    /// links and set elements that belong to none of them, and deletes the
    /// table when no open run is left.
    pub(crate) async fn sweep(&self, runs_dir: &Path) -> Result<(), LaneError> {
        self.load(runs_dir);
        let _table = self.nft_lock.lock().await;
        let live: HashSet<String> = self
            .allocator()
            .runs
            .values()
            .filter(|a| a.table == self.table)
            .map(|a| a.host_if.clone())
            .collect();
        for link in links().await? {
            let ours = link
                .alias
                .as_deref()
                .and_then(parse_link_alias)
                .is_some_and(|(table, _)| table == self.table);
            if ours && link.name.starts_with(HOST_IF_PREFIX) && !live.contains(&link.name) {
                tracing::info!(link = %link.name, "removing a leftover open-tier interface");
                delete_link(&link.name).await?;
            }
        }
        if !self.nft_present || !table_exists(&self.table).await? {
            return Ok(());
        }
        if live.is_empty() {
            tracing::info!(table = %self.table, "no open run left; deleting the nftables table");
            return nft(&format!("delete table inet {}\n", self.table)).await;
        }
        for element in elements(&self.table).await? {
            if !live.contains(&element) && valid_host_ifname(&element) {
                delete_element(&self.table, &element).await?;
            }
        }
        Ok(())
    }
}

/// The script that creates `table` if it is missing and (re)writes its
/// rules, leaving the set's elements alone. One transaction: other runs are
/// never unfiltered while the chains are rewritten.
fn table_script(table: &str, pool: &OpenPool) -> String {
    let t = format!("inet {table}");
    format!(
        "add table {t}
add set {t} {OPEN_IFS_SET} {{ type ifname; }}
add chain {t} input {{ type filter hook input priority filter; policy accept; }}
add chain {t} forward {{ type filter hook forward priority filter; policy accept; }}
add chain {t} postrouting {{ type nat hook postrouting priority srcnat; policy accept; }}
flush chain {t} input
flush chain {t} forward
flush chain {t} postrouting
add rule {t} input iifname @{OPEN_IFS_SET} ct state established,related accept
add rule {t} input iifname @{OPEN_IFS_SET} drop
add rule {t} forward iifname @{OPEN_IFS_SET} oifname @{OPEN_IFS_SET} drop
add rule {t} postrouting ip saddr {pool} oifname != @{OPEN_IFS_SET} masquerade
"
    )
}

/// Why the open tier cannot work on this host, or None when it can.
fn probe(pool: &OpenPool, table: &str) -> Option<String> {
    if crate::probe::which("nft").is_none() {
        return Some(
            "the open network tier needs nftables, and `nft` is not installed \
             (apt-get install -y nftables)"
                .to_owned(),
        );
    }
    if !Path::new(IP_FORWARD).exists() {
        return Some(format!(
            "the open network tier needs IPv4 forwarding, and {IP_FORWARD} is missing"
        ));
    }
    // --check sends the whole transaction to the kernel without committing
    // it: it proves the table can be made without leaving it on the host.
    let checked = std::process::Command::new("nft")
        .args(["--check", "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            if let Some(mut stdin) = child.stdin.take() {
                stdin.write_all(table_script(table, pool).as_bytes())?;
            }
            child.wait_with_output()
        });
    match checked {
        Ok(out) if out.status.success() => None,
        Ok(out) => Some(format!(
            "the open network tier needs nftables, and nft refused runbox's table: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Err(e) => Some(format!(
            "the open network tier needs nftables, and nft could not be run: {e}"
        )),
    }
}

fn write_record(run_dir: &Path, allocation: &Allocation) -> Result<(), LaneError> {
    // Written whole or not at all (rename), so a crash never leaves a
    // record sweep cannot read. No fsync: everything it describes is gone
    // after a power loss anyway.
    let tmp = run_dir.join(format!("{NET_RECORD}.tmp"));
    let path = run_dir.join(NET_RECORD);
    std::fs::write(&tmp, allocation.to_json())
        .and_then(|()| std::fs::rename(&tmp, &path))
        .map_err(LaneError::io(format!("writing {}", path.display())))
}

/// The record in `run_dir`: None when there is none, Err when it is there
/// but unusable.
fn read_record(run_dir: &Path) -> Result<Option<Allocation>, String> {
    let path = run_dir.join(NET_RECORD);
    match std::fs::read(&path) {
        Ok(data) => Allocation::from_json(&data)
            .map(Some)
            .ok_or_else(|| format!("{} is not a valid network record", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("reading {}: {e}", path.display())),
    }
}

/// Turns on IPv4 forwarding, which NAT for open runs needs, when it is off.
/// It is a host-wide setting, so changing it is logged, and it is left on.
fn enable_forwarding() -> Result<(), LaneError> {
    let current = std::fs::read_to_string(IP_FORWARD)
        .map_err(LaneError::io(format!("reading {IP_FORWARD}")))?;
    if current.trim() == "1" {
        return Ok(());
    }
    std::fs::write(IP_FORWARD, "1\n").map_err(LaneError::io(format!(
        "enabling IPv4 forwarding ({IP_FORWARD}) for open-tier runs"
    )))?;
    tracing::warn!(
        was = current.trim(),
        "changed a host setting: net.ipv4.ip_forward = 1 (open-tier runs need it); runbox leaves it on"
    );
    Ok(())
}

/// Writes `<run_dir>/resolv.conf` from the host's resolver configuration.
fn write_resolv_conf(run_dir: &Path) -> Result<PathBuf, LaneError> {
    let mut generated = String::new();
    let mut servers = 0;
    for source in HOST_RESOLV_CONFS {
        let Some(host) = read_small(Path::new(source)) else {
            continue;
        };
        (generated, servers) = resolv_conf_for_run(&host);
        if servers > 0 {
            break;
        }
    }
    if servers == 0 {
        generated.clear();
        tracing::warn!(
            "the host's resolv.conf names no nameserver an open run can reach \
             (loopback ones are the host's own); open runs get an empty /etc/resolv.conf"
        );
    }
    let path = run_dir.join("resolv.conf");
    {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o644)
            .open(&path)
            .and_then(|mut f| f.write_all(generated.as_bytes()))
            .map_err(LaneError::io(format!("writing {}", path.display())))?;
    }
    Ok(path)
}

fn read_small(path: &Path) -> Option<String> {
    let mut data = String::new();
    std::fs::File::open(path)
        .ok()?
        .take(MAX_RESOLV_CONF)
        .read_to_string(&mut data)
        .ok()?;
    Some(data)
}

/// A resolv.conf for a run from the host's: the nameservers a run can
/// reach (IPv4, not loopback: a run's loopback is its own, and the host's
/// addresses are closed to it), plus `search`, `domain` and `options`.
/// Returns the text and how many nameservers it names.
fn resolv_conf_for_run(host: &str) -> (String, usize) {
    let mut out = String::from("# generated by runbox from the host's resolv.conf\n");
    let mut servers = 0;
    for line in host.lines() {
        let line = line.trim();
        let mut words = line.split_whitespace();
        match words.next() {
            Some("nameserver") => {
                // IPv6 servers are dropped: open runs have no IPv6 route.
                let usable = words
                    .next()
                    .and_then(|a| a.parse::<IpAddr>().ok())
                    .is_some_and(|a| match a {
                        IpAddr::V4(v4) => !v4.is_loopback() && !v4.is_unspecified(),
                        IpAddr::V6(_) => false,
                    });
                if usable {
                    out.push_str(line);
                    out.push('\n');
                    servers += 1;
                }
            }
            Some("search" | "domain" | "options") => {
                out.push_str(line);
                out.push('\n');
            }
            _ => {}
        }
    }
    (out, servers)
}

/// A host interface and its alias.
#[derive(Debug)]
struct Link {
    name: String,
    alias: Option<String>,
}

/// The host's interfaces whose names start with [`HOST_IF_PREFIX`].
async fn links() -> Result<Vec<Link>, LaneError> {
    let out = output(Command::new("ip").args(["-j", "link", "show"]), None)
        .await
        .map_err(|e| LaneError::Failed(format!("ip -j link show: {e}")))?;
    let list: serde_json::Value = serde_json::from_slice(&out)
        .map_err(|e| LaneError::Failed(format!("parsing `ip -j link show`: {e}")))?;
    Ok(list
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|l| {
            let name = l.get("ifname")?.as_str()?;
            name.starts_with(HOST_IF_PREFIX).then(|| Link {
                name: name.to_owned(),
                alias: l.get("ifalias").and_then(|a| a.as_str()).map(str::to_owned),
            })
        })
        .collect())
}

/// Deletes a link (both ends of a veth); gone already is fine.
async fn delete_link(name: &str) -> Result<(), LaneError> {
    match output(
        Command::new("ip").args(["link", "delete", "dev", name]),
        None,
    )
    .await
    {
        Ok(_) => Ok(()),
        Err(_) if !links().await?.iter().any(|l| l.name == name) => Ok(()),
        Err(e) => Err(LaneError::Failed(format!("ip link delete {name}: {e}"))),
    }
}

async fn table_exists(table: &str) -> Result<bool, LaneError> {
    let out = output(Command::new("nft").args(["list", "tables", "inet"]), None)
        .await
        .map_err(|e| LaneError::Failed(format!("nft list tables: {e}")))?;
    let wanted = format!("table inet {table}");
    Ok(String::from_utf8_lossy(&out)
        .lines()
        .any(|l| l.trim() == wanted))
}

/// The elements of `table`'s `open_ifs` set.
async fn elements(table: &str) -> Result<Vec<String>, LaneError> {
    let out = output(
        Command::new("nft").args(["-j", "list", "set", "inet", table, OPEN_IFS_SET]),
        None,
    )
    .await
    .map_err(|e| LaneError::Failed(format!("listing {table}'s {OPEN_IFS_SET}: {e}")))?;
    let value: serde_json::Value = serde_json::from_slice(&out)
        .map_err(|e| LaneError::Failed(format!("parsing nft's set listing: {e}")))?;
    Ok(value["nftables"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|item| item.get("set")?.get("elem")?.as_array())
        .flatten()
        .filter_map(|e| e.as_str().map(str::to_owned))
        .collect())
}

/// Removes `name` from `table`'s set; a missing element or table is fine.
async fn delete_element(table: &str, name: &str) -> Result<(), LaneError> {
    // Adding first makes the delete succeed whether or not it was there,
    // in one transaction.
    let script = format!(
        "add element inet {table} {OPEN_IFS_SET} {{ \"{name}\" }}\n\
         delete element inet {table} {OPEN_IFS_SET} {{ \"{name}\" }}\n"
    );
    match nft(&script).await {
        Ok(()) => Ok(()),
        Err(_) if !table_exists(table).await? => Ok(()),
        Err(e) => Err(e),
    }
}

/// Runs an nftables script as one transaction.
async fn nft(script: &str) -> Result<(), LaneError> {
    let mut cmd = Command::new("nft");
    cmd.args(["-f", "-"]);
    output(&mut cmd, Some(script.as_bytes()))
        .await
        .map(drop)
        .map_err(|e| LaneError::Failed(format!("nft: {e}")))
}

/// Runs `ip` commands in batch mode (stopping at the first error), in the
/// named network namespace or the host's.
async fn ip_batch(netns: Option<&str>, commands: &[String]) -> Result<(), LaneError> {
    let mut cmd = Command::new("ip");
    if let Some(ns) = netns {
        cmd.args(["-n", ns]);
    }
    cmd.args(["-batch", "-"]);
    let script = commands.join("\n") + "\n";
    output(&mut cmd, Some(script.as_bytes()))
        .await
        .map(drop)
        .map_err(|e| LaneError::Failed(format!("ip: {e} (while running: {})", commands.join("; "))))
}

/// Runs a helper command with `input` on its stdin; Ok is its stdout, Err
/// its stderr (or why it did not run).
async fn output(cmd: &mut Command, input: Option<&[u8]>) -> Result<Vec<u8>, String> {
    cmd.stdin(if input.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .kill_on_drop(true);
    let run = async {
        let mut child = cmd.spawn().map_err(|e| e.to_string())?;
        if let (Some(data), Some(mut stdin)) = (input, child.stdin.take()) {
            stdin.write_all(data).await.map_err(|e| e.to_string())?;
        }
        child.wait_with_output().await.map_err(|e| e.to_string())
    };
    let out = tokio::time::timeout(COMMAND_TIMEOUT, run)
        .await
        .map_err(|_| format!("timed out after {COMMAND_TIMEOUT:?}"))??;
    if out.status.success() {
        Ok(out.stdout)
    } else {
        let err = String::from_utf8_lossy(&out.stderr).trim().to_owned();
        Err(if err.is_empty() {
            out.status.to_string()
        } else {
            err
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pools_parse_and_validate() {
        let pool: OpenPool = "10.231.0.0/16".parse().unwrap();
        assert_eq!(pool, DEFAULT_OPEN_POOL);
        assert_eq!(pool.to_string(), "10.231.0.0/16");
        assert_eq!(pool.slots(), 16384);
        let first = pool.subnet(0).unwrap();
        assert_eq!(first.to_string(), "10.231.0.0/30");
        assert_eq!(first.host(), Ipv4Addr::new(10, 231, 0, 1));
        assert_eq!(first.run(), Ipv4Addr::new(10, 231, 0, 2));
        let last = pool.subnet(16383).unwrap();
        assert_eq!(last.to_string(), "10.231.255.252/30");
        assert_eq!(last.run(), Ipv4Addr::new(10, 231, 255, 254));
        assert!(pool.subnet(16384).is_none());
        assert_eq!("192.0.2.4/30".parse::<OpenPool>().unwrap().slots(), 1);

        for bad in [
            "10.231.0.0",
            "10.231.0.0/",
            "x/16",
            "10.231.0.0/16/1",
            "::1/64",
        ] {
            assert!(
                matches!(bad.parse::<OpenPool>(), Err(PoolError::Syntax(_))),
                "{bad}"
            );
        }
        for bad in ["10.0.0.0/7", "0.0.0.0/0", "10.0.0.0/31", "10.0.0.0/32"] {
            assert!(
                matches!(bad.parse::<OpenPool>(), Err(PoolError::Prefix(_))),
                "{bad}"
            );
        }
        assert!(matches!(
            "10.231.0.1/16".parse::<OpenPool>(),
            Err(PoolError::HostBits(..))
        ));
        assert!("10.0.0.4/31".parse::<Subnet>().is_err());
        assert_eq!(
            "10.0.0.4/30".parse::<Subnet>().unwrap().run(),
            Ipv4Addr::new(10, 0, 0, 6)
        );
    }

    #[test]
    fn host_names_fit_and_follow_the_id() {
        let id = Ulid::from_string("01J9ZQ3V5X8K2M4N6P7R8S9T0V").unwrap();
        let name = host_ifname(id);
        assert_eq!(name, "rbx6p7r8s9t0v");
        assert_eq!(name.len(), 13);
        for _ in 0..100 {
            let name = host_ifname(Ulid::new());
            assert!(name.len() <= 15 && valid_host_ifname(&name), "{name}");
        }
        assert!(!valid_host_ifname("rbx"));
        assert!(!valid_host_ifname("rbxABCDEFGHIJ"));
        assert!(!valid_host_ifname("eth0"));
    }

    #[test]
    fn table_names_are_plain_identifiers() {
        for ok in ["runbox", "rbxt_01j", "a"] {
            assert!(valid_table_name(ok), "{ok}");
        }
        for bad in ["", "1abc", "a b", "a;flush ruleset", "a-b", &"a".repeat(33)] {
            assert!(!valid_table_name(bad), "{bad}");
        }
    }

    #[test]
    fn aliases_round_trip() {
        let id = Ulid::new();
        let alias = link_alias("runbox", id);
        assert_eq!(parse_link_alias(&alias), Some(("runbox", id)));
        assert_eq!(parse_link_alias("docker0"), None);
        assert_eq!(parse_link_alias(&format!("runbox:t:{id}:x")), None);
    }

    #[test]
    fn records_round_trip_and_reject_bad_names() {
        let a = Allocation {
            subnet: "10.231.0.8/30".parse().unwrap(),
            host_if: "rbxabcdefghij".into(),
            table: "runbox".into(),
        };
        assert_eq!(Allocation::from_json(&a.to_json()), Some(a.clone()));
        let evil = serde_json::json!({
            "subnet": "10.231.0.8/30",
            "hostIf": "rbx; reboot",
            "table": "runbox",
        });
        assert_eq!(Allocation::from_json(evil.to_string().as_bytes()), None);
        assert_eq!(Allocation::from_json(b"{"), None);
    }

    #[test]
    fn allocation_is_round_robin_and_never_shared() {
        let pool: OpenPool = "10.1.0.0/29".parse().unwrap();
        let mut alloc = Allocator::default();
        let (a, b, c) = (Ulid::new(), Ulid::new(), Ulid::new());
        let sa = alloc.reserve(&pool, a, "t").unwrap().subnet;
        let sb = alloc.reserve(&pool, b, "t").unwrap().subnet;
        assert_ne!(sa, sb);
        let full = alloc.reserve(&pool, c, "t").unwrap_err();
        assert!(full.contains("full"), "{full}");
        alloc.runs.remove(&a);
        // The freed /30 is the only one left, so it is reused.
        assert_eq!(alloc.reserve(&pool, c, "t").unwrap().subnet, sa);

        // Round robin: a freed slot is not the next one handed out.
        let pool: OpenPool = "10.1.0.0/24".parse().unwrap();
        let mut alloc = Allocator::default();
        let first = alloc.reserve(&pool, Ulid::new(), "t").unwrap();
        let (id, _) = alloc
            .runs
            .iter()
            .next()
            .map(|(k, v)| (*k, v.clone()))
            .unwrap();
        alloc.runs.remove(&id);
        assert_ne!(
            alloc.reserve(&pool, Ulid::new(), "t").unwrap().subnet,
            first.subnet
        );
    }

    #[test]
    fn interface_name_clashes_are_refused() {
        let pool = DEFAULT_OPEN_POOL;
        let mut alloc = Allocator::default();
        let a = Ulid::from_string("01J9ZQ3V5X8K2M4N6P7R8S9T0V").unwrap();
        let b = Ulid::from_string("01J9ZQ3V5YAAAAAA6P7R8S9T0V").unwrap();
        alloc.reserve(&pool, a, "t").unwrap();
        let err = alloc.reserve(&pool, b, "t").unwrap_err();
        assert!(err.contains(&a.to_string()), "{err}");
    }

    #[test]
    fn resolv_conf_keeps_reachable_servers_only() {
        let host = "# comment\n\
                    nameserver 127.0.0.53\n\
                    nameserver 10.0.0.2\n\
                    nameserver ::1\n\
                    nameserver 2001:db8::1\n\
                    nameserver fe80::1%eth0\n\
                    nameserver 0.0.0.0\n\
                    nameserver bogus\n\
                    search example.com\n\
                    options edns0 trust-ad\n\
                    sortlist 10.0.0.0\n";
        let (out, n) = resolv_conf_for_run(host);
        assert_eq!(n, 1);
        assert!(out.contains("nameserver 10.0.0.2\n"));
        assert!(!out.contains("127.0.0.53") && !out.contains("::1") && !out.contains("2001"));
        assert!(out.contains("search example.com\n"));
        assert!(out.contains("options edns0 trust-ad\n"));
        assert!(!out.contains("sortlist"));

        let (_, n) = resolv_conf_for_run("nameserver 127.0.0.53\noptions edns0\n");
        assert_eq!(n, 0);
    }

    #[test]
    fn the_table_script_filters_what_the_doc_says() {
        let script = table_script("runbox", &DEFAULT_OPEN_POOL);
        for rule in [
            "add rule inet runbox input iifname @open_ifs ct state established,related accept",
            "add rule inet runbox input iifname @open_ifs drop",
            "add rule inet runbox forward iifname @open_ifs oifname @open_ifs drop",
            "add rule inet runbox postrouting ip saddr 10.231.0.0/16 oifname != @open_ifs masquerade",
        ] {
            assert!(script.lines().any(|l| l == rule), "missing {rule:?} in\n{script}");
        }
        // Flushes come before the rules so re-running replaces, not appends.
        let flush = script.find("flush chain inet runbox input").unwrap();
        assert!(flush < script.find("add rule").unwrap());
        assert!(!script.contains("delete") && !script.contains("flush set"));
    }
}
