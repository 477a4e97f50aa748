//! `vrnic serve --metrics ADDR:PORT`: the vRNICs' counters (what `vrnic stats` shows) and
//! state (`vrnic ls`) in Prometheus' exposition format (OpenMetrics text) at `/metrics`,
//! labelled by vRNIC, group and host. Built with `prometheus-client` and served by `axum` on a
//! thread of its own; each scrape asks the daemon over its admin socket, as the CLI does, so
//! the exporter reads nothing the daemon's loop owns and costs the data path nothing between
//! scrapes. Counters are the engine's exact counts since each vRNIC was made: they reset only
//! when the vRNIC goes (a vRNIC made again under the same name starts again from zero, which
//! Prometheus' `rate()` takes as a counter reset).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;

use anyhow::{Context, Result};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tracing::{info, warn};
use vrnic_api::ClassStats;

use crate::admin::AdminClient;

/// The OpenMetrics text format's content type.
const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Vnic {
    vnic: String,
    group: String,
    host: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Class {
    vnic: String,
    group: String,
    host: String,
    class: String,
}

/// A vRNIC's labels and a connection-manager step (`connect`, `request`, `established`,
/// `rejected`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CmStep {
    vnic: String,
    group: String,
    host: String,
    step: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Status {
    vnic: String,
    group: String,
    host: String,
    status: String,
}

/// Binds `addr` now (an address in use is an error at start) and serves `/metrics` from a
/// thread of its own for the daemon's life.
pub fn start(addr: SocketAddr, state_dir: PathBuf) -> Result<()> {
    let listener = std::net::TcpListener::bind(addr)
        .with_context(|| format!("bind the metrics address {addr} (--metrics)"))?;
    listener.set_nonblocking(true)?;
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "localhost".into());
    std::thread::Builder::new()
        .name("vrnic-metrics".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_io()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => return warn!("metrics: no runtime: {e}"),
            };
            let served = rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener)?;
                let app = axum::Router::new().route(
                    "/metrics",
                    axum::routing::get(move || scrape(state_dir.clone(), host.clone())),
                );
                axum::serve(listener, app).await
            });
            if let Err(e) = served {
                warn!("metrics: the server stopped: {e}");
            }
        })
        .context("start the metrics thread")?;
    info!(%addr, "serving Prometheus metrics at /metrics");
    Ok(())
}

async fn scrape(dir: PathBuf, host: String) -> Response {
    match tokio::task::spawn_blocking(move || render(&dir, &host)).await {
        Ok(Ok(body)) => ([(header::CONTENT_TYPE, CONTENT_TYPE)], body).into_response(),
        Ok(Err(e)) => (StatusCode::SERVICE_UNAVAILABLE, format!("{e:#}\n")).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")).into_response(),
    }
}

/// One scrape: the daemon's stats and listing, as OpenMetrics text.
fn render(dir: &Path, host: &str) -> Result<String> {
    let mut c = AdminClient::connect(dir)?;
    let (stats, list) = c.stats_and_list()?;

    let mut reg = Registry::default();
    let sent_wrs = Family::<Class, Counter>::default();
    let sent_bytes = Family::<Class, Counter>::default();
    let recv_msgs = Family::<Class, Counter>::default();
    let recv_bytes = Family::<Class, Counter>::default();
    let completions = Family::<Status, Counter>::default();
    let rnr_naks = Family::<Vnic, Counter>::default();
    let naks = Family::<Vnic, Counter>::default();
    let ud_dropped = Family::<Vnic, Counter>::default();
    let qos_waits = Family::<Vnic, Counter>::default();
    let qos_wait_s = Family::<Vnic, Counter<f64, AtomicU64>>::default();
    let cm = Family::<CmStep, Counter>::default();
    let qps = Family::<Vnic, Gauge>::default();
    let users = Family::<Vnic, Gauge>::default();
    let max_bw = Family::<Vnic, Gauge>::default();
    let max_rate = Family::<Vnic, Gauge>::default();

    let labels = |name: &str, group: &str| Vnic {
        vnic: name.to_string(),
        group: group.to_string(),
        host: host.to_string(),
    };
    for s in &stats {
        let l = labels(&s.name, &s.group);
        let classes = |c: &ClassStats| {
            [
                ("send", c.send),
                ("write", c.write),
                ("read", c.read),
                ("atomic", c.atomic),
            ]
        };
        let with = |class: &str| Class {
            vnic: l.vnic.clone(),
            group: l.group.clone(),
            host: l.host.clone(),
            class: class.to_string(),
        };
        for (class, f) in classes(&s.sent) {
            sent_wrs.get_or_create(&with(class)).inc_by(f.wrs);
            sent_bytes.get_or_create(&with(class)).inc_by(f.bytes);
        }
        for (class, f) in classes(&s.received) {
            recv_msgs.get_or_create(&with(class)).inc_by(f.wrs);
            recv_bytes.get_or_create(&with(class)).inc_by(f.bytes);
        }
        for (status, n) in &s.completions {
            completions
                .get_or_create(&Status {
                    vnic: l.vnic.clone(),
                    group: l.group.clone(),
                    host: l.host.clone(),
                    status: status.clone(),
                })
                .inc_by(*n);
        }
        rnr_naks.get_or_create(&l).inc_by(s.rnr_naks);
        naks.get_or_create(&l).inc_by(s.naks);
        ud_dropped.get_or_create(&l).inc_by(s.ud_dropped);
        qos_waits.get_or_create(&l).inc_by(s.qos_waits);
        qos_wait_s
            .get_or_create(&l)
            .inc_by(s.qos_waited_us as f64 / 1e6);
        for (step, n) in [
            ("connect", s.cm.connects),
            ("request", s.cm.requests),
            ("established", s.cm.established),
            ("rejected", s.cm.rejected),
        ] {
            cm.get_or_create(&CmStep {
                vnic: l.vnic.clone(),
                group: l.group.clone(),
                host: l.host.clone(),
                step: step.to_string(),
            })
            .inc_by(n);
        }
    }
    let gauge = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    for v in &list {
        let l = labels(&v.name, &v.group);
        qps.get_or_create(&l).set(gauge(v.qps as u64));
        users.get_or_create(&l).set(gauge(v.users as u64));
        if let Some(b) = v.max_bw {
            max_bw.get_or_create(&l).set(gauge(b));
        }
        if let Some(r) = v.max_rate {
            max_rate.get_or_create(&l).set(gauge(r));
        }
    }

    reg.register(
        "vrnic_sent_work_requests",
        "Work requests completed successfully as requester, by opcode class",
        sent_wrs,
    );
    reg.register(
        "vrnic_sent_bytes",
        "Payload bytes of those work requests, by opcode class",
        sent_bytes,
    );
    reg.register(
        "vrnic_received_messages",
        "Messages received, WRITEs placed, READs served, atomics executed as responder",
        recv_msgs,
    );
    reg.register(
        "vrnic_received_bytes",
        "Payload bytes of those, by opcode class",
        recv_bytes,
    );
    reg.register(
        "vrnic_completions",
        "Completions posted to the vRNIC's CQs, by status",
        completions,
    );
    reg.register("vrnic_rnr_naks", "RNR NAKs sent as responder", rnr_naks);
    reg.register(
        "vrnic_naks",
        "Requests refused with a NAK as responder",
        naks,
    );
    reg.register(
        "vrnic_ud_dropped",
        "UD datagrams dropped at its QPs (wrong Q_Key, no receive)",
        ud_dropped,
    );
    reg.register(
        "vrnic_qos_waits",
        "Times its QoS limit held it back",
        qos_waits,
    );
    reg.register(
        "vrnic_qos_wait_seconds",
        "Time its QoS limit held it back",
        qos_wait_s,
    );
    reg.register(
        "vrnic_cm",
        "rdma_cm steps of its ids: connect calls, requests its listeners got, connections \
         established, rejections received",
        cm,
    );
    reg.register("vrnic_qps", "Its QPs now", qps);
    reg.register("vrnic_users", "Attached contexts and holders now", users);
    reg.register(
        "vrnic_max_bw_bytes_per_second",
        "Its bandwidth limit (absent: none)",
        max_bw,
    );
    reg.register(
        "vrnic_max_rate_work_requests_per_second",
        "Its message-rate limit (absent: none)",
        max_rate,
    );
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &reg)?;
    Ok(out)
}
