//! The vrnic virtual layer daemon: owns the vRNICs of a host, their shared regions and
//! sockets, serves the control path, and drives the engine over the rings.
//!
//! `vrnic serve` is [`serve`] with [`ServeOptions`] from the command line, or from a config
//! file ([`settings`]); there is nothing to configure on one host (the embedded default), and
//! several hosts need only each one's `listen` address and the others' (`peers`), or, for a
//! cluster, each one's `listen` address and etcd's URLs (`etcd`). One loop thread owns the
//! sockets, the control path and the connection manager; the data path is one or more shards,
//! each an engine with the vRNICs it serves behind a mutex, run by the loop itself
//! (`--engine-threads 1`, the default) or by an engine thread each (cluster mode's etcd client
//! has a thread of its own too). See [`server`] for the loop and how it spins and sleeps, and
//! its `shard` module for who may lock what, in which order.
//!
//! The state dir holds `vrnic.sock` (the admin socket the CLI talks to), `daemon.lock` (one
//! daemon per state dir), and one directory per vRNIC with its `region` file and `sock`. The
//! vRNICs made by `vrnic create` are also recorded outside it ([`persist`]), and made again
//! when the daemon starts.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod admin;
mod cm;
pub mod config;
pub mod heap;
pub mod keys;
mod metrics;
pub mod mntns;
pub mod persist;
pub mod server;
pub mod settings;
mod sys;

pub use server::{ClusterOptions, DEFAULT_TTL_S, Limits, PeerOptions, ServeOptions, serve};
