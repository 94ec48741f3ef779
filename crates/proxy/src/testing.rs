//! Test support: a small authoritative DNS server on loopback, so tests can
//! make names such as `allowed.test` resolve to addresses they choose.
//!
//! Built for this crate's own tests and, with the `testing` feature, for other
//! crates' tests. It is not a DNS server for production: it answers A and AAAA
//! from a table, NODATA for other types of a known name, NXDOMAIN for unknown
//! names, and carries an SOA in every negative answer so resolvers can cache
//! it. Names are matched case-insensitively.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use hickory_resolver::proto::op::{Edns, Message, OpCode, ResponseCode};
use hickory_resolver::proto::rr::rdata::{A, AAAA, SOA};
use hickory_resolver::proto::rr::{Name, RData, Record, RecordType};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio_util::sync::CancellationToken;

/// Negative-caching TTL for unknown names: short, so a test that sets a name
/// after a failed lookup does not wait long for the resolver to notice.
const NXDOMAIN_TTL: u32 = 1;
/// Largest DNS message accepted over TCP or UDP.
const MAX_MESSAGE: usize = 65_535;

/// A loopback DNS server for tests. Serves until dropped.
pub struct TestDns {
    addr: SocketAddr,
    state: Arc<State>,
    shutdown: CancellationToken,
}

/// What the server answers from, shared with its tasks.
#[derive(Default)]
struct State {
    /// Lowercase fully qualified name → its answers.
    names: Mutex<HashMap<String, Entry>>,
    /// Queries received, over UDP and TCP.
    queries: AtomicU64,
}

/// The answers for one name.
#[derive(Clone)]
struct Entry {
    addrs: Vec<IpAddr>,
    ttl: u32,
}

impl std::fmt::Debug for TestDns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestDns").field("addr", &self.addr).finish()
    }
}

impl TestDns {
    /// Serves on 127.0.0.1:<random port> (UDP and TCP) until dropped.
    pub async fn start() -> std::io::Result<TestDns> {
        let (udp, tcp) = bind_pair().await?;
        let addr = udp.local_addr()?;
        let state = Arc::new(State::default());
        let shutdown = CancellationToken::new();
        tokio::spawn(serve_udp(udp, state.clone(), shutdown.clone()));
        tokio::spawn(serve_tcp(tcp, state.clone(), shutdown.clone()));
        Ok(TestDns {
            addr,
            state,
            shutdown,
        })
    }

    /// The address to use as the nameserver (UDP and TCP).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sets the A/AAAA answers for `name` (FQDN or not), replacing earlier ones.
    pub fn set(&self, name: &str, addrs: &[IpAddr], ttl_secs: u32) {
        let entry = Entry {
            addrs: addrs.to_vec(),
            ttl: ttl_secs,
        };
        self.state.names().insert(key(name), entry);
    }

    /// Forgets `name`: it answers NXDOMAIN again.
    pub fn remove(&self, name: &str) {
        self.state.names().remove(&key(name));
    }

    /// Number of queries received so far (to test caching).
    pub fn queries(&self) -> u64 {
        self.state.queries.load(Ordering::SeqCst)
    }
}

impl Drop for TestDns {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl State {
    fn names(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        // A test that panicked while holding the table leaves it whole.
        self.names.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The table key for `name`: lowercase, with the root dot.
fn key(name: &str) -> String {
    let mut key = name.to_ascii_lowercase();
    if !key.ends_with('.') {
        key.push('.');
    }
    key
}

/// A UDP socket and a TCP listener on the same loopback port. The UDP port is
/// picked first; if its TCP twin is taken, another port is tried.
async fn bind_pair() -> std::io::Result<(UdpSocket, TcpListener)> {
    let mut last_error = None;
    for _ in 0..16 {
        let udp = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        match TcpListener::bind(udp.local_addr()?).await {
            Ok(tcp) => return Ok((udp, tcp)),
            Err(e) => last_error = Some(e),
        }
    }
    Err(last_error.unwrap_or_else(|| std::io::Error::other("no free port pair")))
}

async fn serve_udp(socket: UdpSocket, state: Arc<State>, shutdown: CancellationToken) {
    let mut buf = vec![0u8; MAX_MESSAGE];
    loop {
        let (len, peer) = tokio::select! {
            _ = shutdown.cancelled() => return,
            received = socket.recv_from(&mut buf) => match received {
                Ok(received) => received,
                Err(_) => continue,
            },
        };
        if let Some(reply) = answer(&state, &buf[..len], true) {
            let _ = socket.send_to(&reply, peer).await;
        }
    }
}

async fn serve_tcp(listener: TcpListener, state: Arc<State>, shutdown: CancellationToken) {
    loop {
        let stream = tokio::select! {
            _ = shutdown.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(_) => continue,
            },
        };
        let state = state.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = serve_tcp_connection(stream, &state) => {}
            }
        });
    }
}

/// Answers length-prefixed queries on one connection until it closes.
async fn serve_tcp_connection(mut stream: TcpStream, state: &State) -> std::io::Result<()> {
    loop {
        let len = usize::from(stream.read_u16().await?);
        let mut request = vec![0u8; len];
        stream.read_exact(&mut request).await?;
        let Some(reply) = answer(state, &request, false) else {
            return Ok(());
        };
        let Ok(reply_len) = u16::try_from(reply.len()) else {
            return Ok(());
        };
        stream.write_u16(reply_len).await?;
        stream.write_all(&reply).await?;
    }
}

/// The encoded reply to `request`, or `None` for something that is not a
/// DNS query at all (dropped, as a real server would).
fn answer(state: &State, request: &[u8], udp: bool) -> Option<Vec<u8>> {
    let request = Message::from_vec(request).ok()?;
    state.queries.fetch_add(1, Ordering::SeqCst);

    let mut response = Message::response(request.metadata.id, request.metadata.op_code);
    response.metadata.recursion_desired = request.metadata.recursion_desired;
    response.metadata.recursion_available = true;
    response.metadata.authoritative = true;
    if request.edns.is_some() {
        let mut edns = Edns::new();
        edns.set_max_payload(u16::try_from(MAX_MESSAGE).unwrap_or(u16::MAX));
        response.set_edns(edns);
    }

    let query = match (request.metadata.op_code, request.queries.first()) {
        (OpCode::Query, Some(query)) if request.queries.len() == 1 => query.clone(),
        _ => {
            response.metadata.response_code = ResponseCode::FormErr;
            return response.to_vec().ok();
        }
    };
    response.add_query(query.clone());

    let entry = state.names().get(&key(&query.name().to_ascii())).cloned();
    match entry {
        None => {
            response.metadata.response_code = ResponseCode::NXDomain;
            response.add_authority(soa(NXDOMAIN_TTL));
        }
        Some(entry) => {
            let records: Vec<Record> = entry
                .addrs
                .iter()
                .filter_map(|addr| {
                    let data = match (query.query_type(), addr) {
                        (RecordType::A, IpAddr::V4(v4)) => RData::A(A(*v4)),
                        (RecordType::AAAA, IpAddr::V6(v6)) => RData::AAAA(AAAA(*v6)),
                        _ => return None,
                    };
                    Some(Record::from_rdata(query.name().clone(), entry.ttl, data))
                })
                .collect();
            if records.is_empty() {
                // NODATA: the name exists, this type does not; cacheable for the
                // name's TTL like its addresses.
                response.add_authority(soa(entry.ttl));
            } else {
                response.add_answers(records);
            }
        }
    }

    let encoded = response.to_vec().ok()?;
    if udp && encoded.len() > usize::from(request.max_payload()) {
        // Too big for the client's UDP buffer: it retries over TCP.
        return response.truncate().to_vec().ok();
    }
    Some(encoded)
}

/// The SOA carried in negative answers; its TTL and minimum set how long a
/// resolver may cache the negative answer.
fn soa(ttl: u32) -> Record {
    let data = SOA::new(
        Name::from_ascii("ns.test.").unwrap_or_default(),
        Name::from_ascii("hostmaster.test.").unwrap_or_default(),
        1,
        3600,
        600,
        86_400,
        ttl,
    );
    Record::from_rdata(Name::root(), ttl, RData::SOA(data))
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_resolver::proto::op::Query;

    async fn ask_udp(dns: &TestDns, name: &str, record_type: RecordType) -> Message {
        let socket = UdpSocket::bind("127.0.0.1:0").await.expect("bind");
        let mut query = Message::query();
        query.add_query(Query::query(
            Name::from_ascii(name).expect("name"),
            record_type,
        ));
        socket
            .send_to(&query.to_vec().expect("encode"), dns.addr())
            .await
            .expect("send");
        let mut buf = vec![0u8; MAX_MESSAGE];
        let len = socket.recv(&mut buf).await.expect("recv");
        let reply = Message::from_vec(&buf[..len]).expect("decode");
        assert_eq!(reply.metadata.id, query.metadata.id);
        reply
    }

    #[tokio::test]
    async fn answers_set_names_and_refuses_unknown_ones() {
        let dns = TestDns::start().await.expect("start");
        dns.set("Host.Test", &["127.0.0.2".parse().expect("ip")], 42);

        let reply = ask_udp(&dns, "host.test.", RecordType::A).await;
        assert_eq!(reply.metadata.response_code, ResponseCode::NoError);
        assert_eq!(reply.answers.len(), 1);
        assert_eq!(reply.answers[0].ttl, 42);

        let reply = ask_udp(&dns, "host.test.", RecordType::AAAA).await;
        assert_eq!(reply.metadata.response_code, ResponseCode::NoError);
        assert!(reply.answers.is_empty());
        assert_eq!(reply.authorities.len(), 1);

        let reply = ask_udp(&dns, "other.test.", RecordType::A).await;
        assert_eq!(reply.metadata.response_code, ResponseCode::NXDomain);

        dns.remove("host.test");
        let reply = ask_udp(&dns, "host.test.", RecordType::A).await;
        assert_eq!(reply.metadata.response_code, ResponseCode::NXDomain);
        assert_eq!(dns.queries(), 4);
    }

    #[tokio::test]
    async fn answers_over_tcp() {
        let dns = TestDns::start().await.expect("start");
        dns.set("tcp.test", &["::1".parse().expect("ip")], 5);
        let mut stream = TcpStream::connect(dns.addr()).await.expect("connect");
        let mut query = Message::query();
        query.add_query(Query::query(
            Name::from_ascii("tcp.test.").expect("name"),
            RecordType::AAAA,
        ));
        let bytes = query.to_vec().expect("encode");
        stream
            .write_u16(u16::try_from(bytes.len()).expect("len"))
            .await
            .expect("write");
        stream.write_all(&bytes).await.expect("write");
        let len = stream.read_u16().await.expect("read");
        let mut buf = vec![0u8; usize::from(len)];
        stream.read_exact(&mut buf).await.expect("read");
        let reply = Message::from_vec(&buf).expect("decode");
        assert_eq!(reply.answers.len(), 1);
    }
}
