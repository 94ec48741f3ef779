//! runbox's egress proxy for the `allowlist` network tier.
//!
//! A run on that tier has no route out of its network namespace. Its only
//! way out is a listener the daemon binds *inside* that namespace and serves
//! from here. This crate owns everything between that listener and the
//! outside world; it does not own namespaces, interfaces or firewall rules
//! (the runtime crate does) nor the API (the server crate does).
//!
//! ```text
//!  run ──HTTP CONNECT / absolute-form──► proxy::serve
//!                                          1. policy::Allowlist::decide(host, port)   deny → 403 naming the fix
//!                                          2. resolve::Resolver::lookup(host)         one lookup, TTL-cached
//!                                          3. guard::AddressGuard::check(addr, port)  private/loopback/... → 403
//!                                          4. connect to the checked address (never a second lookup)
//!                                          5. blind tunnel, or — for a host with a secret rule —
//!                                             tls::Authority intercepts and secrets::inject rewrites headers
//!                                          6. counters + audit::AuditLog record the decision
//! ```
//!
//! A run that asks for it has a second door, SOCKS5 (`socks`), whose
//! CONNECTs take the same steps 1–6 as an HTTP CONNECT.
//!
//! Policy evaluation (`policy`, `guard`, `secrets`) is pure and tested without
//! sockets; `proxy` wires it to real connections.

pub mod audit;
pub mod guard;
pub mod policy;
pub mod proxy;
pub mod resolve;
pub mod rules;
pub mod secrets;
pub mod socks;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod tls;
pub mod upstream;
