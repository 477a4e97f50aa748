/*
 * mw_check: memory windows from two processes (server and client on separate vRNICs of one
 * daemon), built against libibverbs-dev and run unmodified under `vrnic run`. The server owns
 * an MR registered with IBV_ACCESS_MW_BIND and no remote access of its own, binds windows over
 * parts of it, and the client reaches its memory only through the windows' rkeys:
 *
 *   mw_check server PORT MODE
 *   mw_check client HOST PORT MODE
 *
 * MODE: type1 (ibv_bind_mw, rebinding, a read-only window, LOCAL_INV refused, the verbs.h
 *       checks, an MR pinned while bound) | type2 (IBV_WR_BIND_MW and ibv_wr_bind_mw, bounds,
 *       LOCAL_INV, SEND_WITH_INV through ibv_wr_send_inv, MW_BIND_ERR on misuse) | rights
 *       (what a window needs of its MR: MW_BIND, and local write for remote write or
 *       atomics, no remote right; LOCAL_WRITE in a window's flags, as rdma-core's tests bind
 *       them, granting nothing remote; type 1 and both type 2 binds; invalidation by
 *       LOCAL_INV and by ibv_dealloc_mw of a bound window). A MODE prefixed "far-" runs
 *       the same with a QP made (and never used) before the server's own, so that on a
 *       daemon with --spread-qps its QP is in another slice than its vRNIC's home, which
 *       allocates the windows and pins the MR.
 *
 * Every check asserts bytes (landed exactly, or not at all) and completion statuses on the side
 * that sees them. After an error both sides move their QPs to RESET and up again. Prints "OK
 * <check>" per passed check; exits 1 with "FAIL ..." on the first failure; every wait is
 * bounded.
 */
#define _GNU_SOURCE
#include <infiniband/verbs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "exchange.h"

#define LEN (64u << 10)
#define SENTINEL 0xEE
#define POLL_SECONDS 20
#define OPS (IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_READ | \
	     IBV_QP_EX_WITH_BIND_MW | IBV_QP_EX_WITH_LOCAL_INV | IBV_QP_EX_WITH_SEND_WITH_INV)

struct info {
	uint32_t lid, qpn, mr_rkey, pad;
	uint64_t addr;
};

struct side {
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_cq *cq;
	struct ibv_qp *qp;
	struct ibv_qp_ex *qpx;
	uint8_t *buf;
	struct ibv_mr *mr;
	struct info me, peer;
	int sock;
};

/* What the server tells the client about a window. */
struct win {
	uint32_t rkey, len;
	uint64_t addr;
};

static void say(struct side *s, uint32_t v) { xfer(s->sock, &v, 4, 1); }
static uint32_t hear(struct side *s) { uint32_t v; xfer(s->sock, &v, 4, 0); return v; }

static void bring_up(struct side *s)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1,
				 .qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ };
	if (ibv_modify_qp(s->qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
		fail("modify INIT");
	a = (struct ibv_qp_attr){ .qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_4096, .dest_qp_num = s->peer.qpn,
				  .max_dest_rd_atomic = 4, .min_rnr_timer = 12,
				  .ah_attr = { .dlid = s->peer.lid, .port_num = 1 } };
	if (ibv_modify_qp(s->qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
				     IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
		fail("modify RTR");
	a = (struct ibv_qp_attr){ .qp_state = IBV_QPS_RTS, .timeout = 14, .retry_cnt = 7, .rnr_retry = 7,
				  .max_rd_atomic = 4 };
	if (ibv_modify_qp(s->qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
				     IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
		fail("modify RTS");
}

/* After an error: both QPs to RESET and up again, in step (neither side resets before the
 * other is done with what failed). */
static void restate(struct side *s)
{
	say(s, 7);
	uint32_t got = hear(s);
	if (got != 7)
		fail("out of step before a restate (heard %u)", got);
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_RESET };
	if (ibv_modify_qp(s->qp, &a, IBV_QP_STATE))
		fail("modify RESET");
	bring_up(s);
	say(s, 8);
	if ((got = hear(s)) != 8)
		fail("out of step after a restate (heard %u)", got);
}

static void setup(struct side *s, int server, int far)
{
	int n;
	struct ibv_device **list = ibv_get_device_list(&n);
	if (!list || n < 1)
		fail("no RDMA device");
	s->ctx = ibv_open_device(list[0]);
	ibv_free_device_list(list);
	if (!s->ctx)
		fail("open device");
	s->pd = ibv_alloc_pd(s->ctx);
	s->cq = ibv_create_cq(s->ctx, 64, NULL, NULL, 0);
	if (!s->pd || !s->cq)
		fail("pd/cq");
	s->buf = aligned_alloc(4096, LEN);
	memset(s->buf, server ? SENTINEL : 0, LEN);
	/* The server's MR allows no remote access by itself: only windows open it. */
	int acc = IBV_ACCESS_LOCAL_WRITE | (server ? IBV_ACCESS_MW_BIND : 0);
	s->mr = ibv_reg_mr(s->pd, s->buf, LEN, acc);
	if (!s->mr)
		fail("reg_mr (MW_BIND %d)", server);
	struct ibv_qp_init_attr_ex ia = {
		.send_cq = s->cq, .recv_cq = s->cq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 1, .max_recv_sge = 1 },
		.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS, .pd = s->pd, .send_ops_flags = OPS,
	};
	if (far && !ibv_create_qp_ex(s->ctx, &ia))
		fail("create the QP made first");
	s->qp = ibv_create_qp_ex(s->ctx, &ia);
	if (!s->qp)
		fail("create_qp_ex with BIND_MW, LOCAL_INV, SEND_WITH_INV");
	s->qpx = ibv_qp_to_qp_ex(s->qp);
	struct ibv_port_attr pa;
	if (ibv_query_port(s->ctx, 1, &pa))
		fail("query_port");
	s->me = (struct info){ .lid = pa.lid, .qpn = s->qp->qp_num, .mr_rkey = s->mr->rkey,
			       .addr = (uintptr_t)s->buf };
	xfer(s->sock, &s->me, sizeof s->me, 1);
	xfer(s->sock, &s->peer, sizeof s->peer, 0);
	bring_up(s);
}

static struct ibv_wc poll1(struct side *s)
{
	struct ibv_wc wc;
	double deadline = now() + POLL_SECONDS;
	for (long i = 0;; i++) {
		int n = ibv_poll_cq(s->cq, 1, &wc);
		if (n < 0)
			fail("poll_cq returned %d", n);
		if (n == 1)
			return wc;
		if ((i & 0xfff) == 0xfff) {
			if (now() > deadline)
				fail("no completion within %d s", POLL_SECONDS);
			usleep(50);
		}
	}
}

static void expect(struct side *s, uint64_t wr_id, enum ibv_wc_status st, enum ibv_wc_opcode op, const char *what)
{
	struct ibv_wc wc = poll1(s);
	if (wc.wr_id != wr_id || wc.status != st || (st == IBV_WC_SUCCESS && wc.opcode != op))
		fail("%s: wr %lu %s opcode %d, expected wr %lu %s opcode %d", what, (unsigned long)wc.wr_id,
		     ibv_wc_status_str(wc.status), wc.opcode, (unsigned long)wr_id, ibv_wc_status_str(st), op);
}

/* Client: one RDMA WRITE or READ of `len` bytes between its buffer at `off` and `raddr`. */
static enum ibv_wc_status rdma(struct side *s, uint64_t id, enum ibv_wr_opcode op, uint32_t off, uint32_t len,
			       uint64_t raddr, uint32_t rkey)
{
	struct ibv_sge sge = { .addr = (uintptr_t)(s->buf + off), .length = len, .lkey = s->mr->lkey };
	struct ibv_send_wr wr = { .wr_id = id, .sg_list = &sge, .num_sge = 1, .opcode = op,
				  .send_flags = IBV_SEND_SIGNALED, .wr.rdma = { .remote_addr = raddr, .rkey = rkey } },
			   *bad;
	if (ibv_post_send(s->qp, &wr, &bad))
		fail("post_send");
	struct ibv_wc wc = poll1(s);
	if (wc.wr_id != id)
		fail("completion of wr %lu, expected %lu", (unsigned long)wc.wr_id, (unsigned long)id);
	return wc.status;
}

/* Server: a bind work request (IBV_WR_BIND_MW through ibv_post_send), its completion. */
static void post_bind(struct side *s, uint64_t id, struct ibv_mw *mw, uint32_t rkey, struct ibv_mr *mr, uint64_t addr,
		      uint64_t len, unsigned acc)
{
	struct ibv_send_wr wr = { .wr_id = id, .opcode = IBV_WR_BIND_MW, .send_flags = IBV_SEND_SIGNALED }, *bad;
	wr.bind_mw.mw = mw;
	wr.bind_mw.rkey = rkey;
	wr.bind_mw.bind_info = (struct ibv_mw_bind_info){ .mr = mr, .addr = addr, .length = len,
							  .mw_access_flags = acc };
	if (ibv_post_send(s->qp, &wr, &bad))
		fail("post BIND_MW");
}

static void post_local_inv(struct side *s, uint64_t id, uint32_t rkey)
{
	struct ibv_send_wr wr = { .wr_id = id, .opcode = IBV_WR_LOCAL_INV, .send_flags = IBV_SEND_SIGNALED,
				  .invalidate_rkey = rkey },
			   *bad;
	if (ibv_post_send(s->qp, &wr, &bad))
		fail("post LOCAL_INV");
}

static void check_bytes(struct side *s, uint32_t off, uint32_t len, uint8_t seed, const char *what)
{
	for (uint32_t i = 0; i < len; i++)
		if (s->buf[off + i] != (uint8_t)(seed + i * 7))
			fail("%s: byte %u is %#x", what, off + i, s->buf[off + i]);
}

static void check_untouched(struct side *s, uint32_t from, uint32_t to, const char *what)
{
	for (uint32_t i = from; i < to; i++)
		if (s->buf[i] != SENTINEL)
			fail("%s: byte %u changed to %#x", what, i, s->buf[i]);
}

static void fill(struct side *s, uint32_t off, uint32_t len, uint8_t seed)
{
	for (uint32_t i = 0; i < len; i++)
		s->buf[off + i] = (uint8_t)(seed + i * 7);
}

static void send_win(struct side *s, uint32_t rkey, uint64_t addr, uint32_t len)
{
	struct win w = { .rkey = rkey, .len = len, .addr = addr };
	xfer(s->sock, &w, sizeof w, 1);
}

static struct win recv_win(struct side *s)
{
	struct win w;
	xfer(s->sock, &w, sizeof w, 0);
	return w;
}

/* ---- type 2 ------------------------------------------------------------------------------ */

static void server_type2(struct side *s)
{
	struct ibv_device_attr da;
	if (ibv_query_device(s->ctx, &da))
		fail("query_device");
	if (!(da.device_cap_flags & IBV_DEVICE_MEM_WINDOW) || !(da.device_cap_flags & IBV_DEVICE_MEM_WINDOW_TYPE_2B) ||
	    da.max_mw <= 0)
		fail("device caps %#x max_mw %d", da.device_cap_flags, da.max_mw);
	ok("IBV_DEVICE_MEM_WINDOW and MEM_WINDOW_TYPE_2B reported, max_mw %d", da.max_mw);
	struct ibv_mw *mw = ibv_alloc_mw(s->pd, IBV_MW_TYPE_2);
	if (!mw || mw->type != IBV_MW_TYPE_2 || mw->pd != s->pd)
		fail("alloc_mw type 2");
	uint64_t base = (uintptr_t)s->buf;
	/* 1. Bound over [4096, 8192) for write and read. */
	uint32_t k1 = ibv_inc_rkey(mw->rkey);
	post_bind(s, 1, mw, k1, s->mr, base + 4096, 4096, IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
	expect(s, 1, IBV_WC_SUCCESS, IBV_WC_BIND_MW, "bind");
	ok("IBV_WR_BIND_MW of a type 2 window: IBV_WC_BIND_MW success");
	send_win(s, k1, base + 4096, 4096);
	hear(s);
	check_bytes(s, 4096, 4096, 0x21, "write through the window");
	check_untouched(s, 0, 4096, "before the window");
	check_untouched(s, 8192, LEN, "after the window");
	ok("the client's write through the window landed exactly in it");
	say(s, 1);
	/* 2. The MR's own rkey, then past the window's end: refused, nothing written. */
	restate(s);
	restate(s);
	check_bytes(s, 4096, 4096, 0x21, "after the refused writes");
	check_untouched(s, 8192, LEN, "after the refused writes");
	ok("the refused writes changed nothing");
	/* 3. LOCAL_INV frees it: its key fails. */
	post_local_inv(s, 3, k1);
	expect(s, 3, IBV_WC_SUCCESS, IBV_WC_LOCAL_INV, "local invalidate");
	ok("IBV_WR_LOCAL_INV of the bound window: IBV_WC_LOCAL_INV success");
	say(s, 1);
	restate(s);
	check_bytes(s, 4096, 4096, 0x21, "after a write through the invalidated key");
	/* 4. Bound again with ibv_wr_bind_mw over [16384, 20480), write only; the client sends
	 *    with invalidate. */
	uint32_t k2 = ibv_inc_rkey(k1);
	struct ibv_mw_bind_info bi = { .mr = s->mr, .addr = base + 16384, .length = 4096,
				       .mw_access_flags = IBV_ACCESS_REMOTE_WRITE };
	ibv_wr_start(s->qpx);
	s->qpx->wr_id = 4;
	s->qpx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_bind_mw(s->qpx, mw, k2, &bi);
	if (ibv_wr_complete(s->qpx))
		fail("wr_complete of wr_bind_mw");
	expect(s, 4, IBV_WC_SUCCESS, IBV_WC_BIND_MW, "wr_bind_mw");
	ok("ibv_wr_bind_mw rebinds the invalidated window under a new key");
	struct ibv_sge rs = { .addr = (uintptr_t)(s->buf + 32768), .length = 256, .lkey = s->mr->lkey };
	struct ibv_recv_wr rw = { .wr_id = 40, .sg_list = &rs, .num_sge = 1 }, *rbad;
	if (ibv_post_recv(s->qp, &rw, &rbad))
		fail("post_recv");
	send_win(s, k2, base + 16384, 4096);
	struct ibv_wc wc = poll1(s);
	if (wc.wr_id != 40 || wc.status || wc.opcode != IBV_WC_RECV || wc.byte_len != 100 ||
	    !(wc.wc_flags & IBV_WC_WITH_INV) || wc.invalidated_rkey != k2)
		fail("receive of SEND_WITH_INV: %s len %u flags %#x invalidated %#x (key %#x)",
		     ibv_wc_status_str(wc.status), wc.byte_len, wc.wc_flags, wc.invalidated_rkey, k2);
	check_bytes(s, 32768, 100, 0x44, "SEND_WITH_INV payload");
	ok("SEND_WITH_INV: receive with IBV_WC_WITH_INV, invalidated_rkey = the window's key, bytes exact");
	say(s, 1);
	restate(s);
	check_bytes(s, 16384, 4096, 0x33, "the window after its key was invalidated");
	ok("after SEND_WITH_INV the window's key writes nothing");
	/* 5. Misuse: a window over an MR without MW_BIND; a bound type 2 window bound again. */
	uint8_t *plain_buf = aligned_alloc(4096, 4096);
	struct ibv_mr *plain = ibv_reg_mr(s->pd, plain_buf, 4096, IBV_ACCESS_LOCAL_WRITE);
	if (!plain)
		fail("reg_mr");
	post_bind(s, 5, mw, ibv_inc_rkey(k2), plain, (uintptr_t)plain_buf, 64, IBV_ACCESS_REMOTE_READ);
	expect(s, 5, IBV_WC_MW_BIND_ERR, 0, "bind to an MR without MW_BIND");
	ok("bind to an MR without IBV_ACCESS_MW_BIND: IBV_WC_MW_BIND_ERR");
	restate(s);
	uint32_t k3 = ibv_inc_rkey(k2);
	post_bind(s, 6, mw, k3, s->mr, base, 64, IBV_ACCESS_REMOTE_READ);
	expect(s, 6, IBV_WC_SUCCESS, IBV_WC_BIND_MW, "bind");
	post_bind(s, 7, mw, ibv_inc_rkey(k3), s->mr, base, 64, IBV_ACCESS_REMOTE_READ);
	expect(s, 7, IBV_WC_MW_BIND_ERR, 0, "second bind of a bound type 2 window");
	ok("a bound type 2 window bound again: IBV_WC_MW_BIND_ERR");
	restate(s);
	post_local_inv(s, 8, k3);
	expect(s, 8, IBV_WC_SUCCESS, IBV_WC_LOCAL_INV, "local invalidate");
	post_bind(s, 9, mw, ibv_inc_rkey(k3), s->mr, base + LEN - 32, 64, IBV_ACCESS_REMOTE_READ);
	expect(s, 9, IBV_WC_MW_BIND_ERR, 0, "bind past the MR");
	ok("a window past its MR's end: IBV_WC_MW_BIND_ERR");
	restate(s);
	/* 6. The MR is pinned while the window is bound; deallocating the window releases it. */
	uint32_t k4 = ibv_inc_rkey(ibv_inc_rkey(k3));
	post_bind(s, 10, mw, k4, s->mr, base, 64, IBV_ACCESS_REMOTE_READ);
	expect(s, 10, IBV_WC_SUCCESS, IBV_WC_BIND_MW, "bind");
	if (ibv_dereg_mr(s->mr) != EINVAL)
		fail("dereg_mr of an MR with a bound window did not answer EINVAL");
	if (ibv_dealloc_pd(s->pd) != EBUSY)
		fail("dealloc_pd with a window");
	if (ibv_dealloc_mw(mw))
		fail("dealloc_mw");
	if (ibv_dereg_mr(plain) || ibv_dereg_mr(s->mr))
		fail("dereg_mr after dealloc_mw");
	ok("dereg_mr with a bound window: EINVAL; after dealloc_mw: 0");
}

static void client_type2(struct side *s)
{
	struct win w = recv_win(s);
	fill(s, 0, 4096, 0x21);
	if (rdma(s, 1, IBV_WR_RDMA_WRITE, 0, 4096, w.addr, w.rkey) != IBV_WC_SUCCESS)
		fail("write through the window");
	memset(s->buf + 8192, 0, 4096);
	if (rdma(s, 2, IBV_WR_RDMA_READ, 8192, 300, w.addr + 1000, w.rkey) != IBV_WC_SUCCESS ||
	    memcmp(s->buf + 8192, s->buf + 1000, 300))
		fail("read back through the window");
	ok("write and read through a type 2 window's rkey: success, bytes exact");
	say(s, 1);
	hear(s);
	enum ibv_wc_status st = rdma(s, 3, IBV_WR_RDMA_WRITE, 0, 16, s->peer.addr + 4096, s->peer.mr_rkey);
	if (st != IBV_WC_REM_ACCESS_ERR)
		fail("write through the MR's own key (no remote access): %s", ibv_wc_status_str(st));
	ok("write through the MR's own rkey (no remote access): IBV_WC_REM_ACCESS_ERR");
	restate(s);
	fill(s, 0, 4096, 0x55);
	st = rdma(s, 4, IBV_WR_RDMA_WRITE, 0, 16, w.addr + w.len - 8, w.rkey);
	if (st != IBV_WC_REM_ACCESS_ERR)
		fail("write past the window's end: %s", ibv_wc_status_str(st));
	ok("write 8 bytes past the window's end (inside the MR): IBV_WC_REM_ACCESS_ERR");
	restate(s);
	hear(s);
	st = rdma(s, 5, IBV_WR_RDMA_WRITE, 0, 16, w.addr, w.rkey);
	if (st != IBV_WC_REM_ACCESS_ERR)
		fail("write through an invalidated key: %s", ibv_wc_status_str(st));
	ok("write through the locally invalidated key: IBV_WC_REM_ACCESS_ERR");
	restate(s);
	struct win w2 = recv_win(s);
	fill(s, 0, 4096, 0x33);
	if (rdma(s, 6, IBV_WR_RDMA_WRITE, 0, 4096, w2.addr, w2.rkey) != IBV_WC_SUCCESS)
		fail("write through the rebound window");
	fill(s, 4096, 100, 0x44);
	ibv_wr_start(s->qpx);
	s->qpx->wr_id = 7;
	s->qpx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_send_inv(s->qpx, w2.rkey);
	ibv_wr_set_sge(s->qpx, s->mr->lkey, (uintptr_t)(s->buf + 4096), 100);
	if (ibv_wr_complete(s->qpx))
		fail("wr_complete of wr_send_inv");
	expect(s, 7, IBV_WC_SUCCESS, IBV_WC_SEND, "SEND_WITH_INV");
	hear(s);
	fill(s, 0, 16, 0x99);
	st = rdma(s, 8, IBV_WR_RDMA_WRITE, 0, 16, w2.addr, w2.rkey);
	if (st != IBV_WC_REM_ACCESS_ERR)
		fail("write through a key invalidated by SEND_WITH_INV: %s", ibv_wc_status_str(st));
	ok("ibv_wr_send_inv completes; the key it invalidated then fails with IBV_WC_REM_ACCESS_ERR");
	restate(s);
	/* The server's three misuse cases (E, F, G), each followed by a restate. */
	restate(s);
	restate(s);
	restate(s);
}

/* ---- type 1 ------------------------------------------------------------------------------ */

static void server_type1(struct side *s)
{
	struct ibv_mw *mw = ibv_alloc_mw(s->pd, IBV_MW_TYPE_1);
	if (!mw || mw->type != IBV_MW_TYPE_1)
		fail("alloc_mw type 1");
	uint64_t base = (uintptr_t)s->buf;
	fill(s, 0, LEN, 0x61);
	/* The verbs.h checks of ibv_bind_mw. */
	struct ibv_mw *mw2 = ibv_alloc_mw(s->pd, IBV_MW_TYPE_2);
	struct ibv_pd *pd2 = ibv_alloc_pd(s->ctx);
	uint8_t *other_buf = aligned_alloc(4096, 4096);
	struct ibv_mr *other = ibv_reg_mr(pd2, other_buf, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND);
	if (!mw2 || !pd2 || !other)
		fail("second window, PD, MR");
	struct ibv_mw_bind b = { .wr_id = 1, .send_flags = IBV_SEND_SIGNALED,
				 .bind_info = { .mr = s->mr, .addr = base, .length = 4096,
						.mw_access_flags = IBV_ACCESS_REMOTE_READ } };
	if (ibv_bind_mw(s->qp, mw2, &b) != EINVAL)
		fail("ibv_bind_mw of a type 2 window");
	b.bind_info.mr = other;
	if (ibv_bind_mw(s->qp, mw, &b) != EPERM)
		fail("ibv_bind_mw to an MR of another PD");
	ok("ibv_bind_mw of a type 2 window: EINVAL; to another PD's MR: EPERM");
	/* 1. Read-only over [0, 4096). */
	b.bind_info.mr = s->mr;
	uint32_t before = mw->rkey;
	if (ibv_bind_mw(s->qp, mw, &b))
		fail("ibv_bind_mw");
	if (mw->rkey == before || (mw->rkey & ~0xffu) != (before & ~0xffu))
		fail("ibv_bind_mw: rkey %#x from %#x", mw->rkey, before);
	expect(s, 1, IBV_WC_SUCCESS, IBV_WC_BIND_MW, "ibv_bind_mw");
	ok("ibv_bind_mw: the window's next key, IBV_WC_BIND_MW success");
	uint32_t k1 = mw->rkey;
	send_win(s, k1, base, 4096);
	restate(s);
	/* 2. Rebound over [8192, 12288) for write. */
	b.wr_id = 2;
	b.bind_info.addr = base + 8192;
	b.bind_info.mw_access_flags = IBV_ACCESS_REMOTE_WRITE;
	if (ibv_bind_mw(s->qp, mw, &b))
		fail("ibv_bind_mw again");
	expect(s, 2, IBV_WC_SUCCESS, IBV_WC_BIND_MW, "rebind");
	send_win(s, mw->rkey, base + 8192, 4096);
	restate(s);
	hear(s);
	check_bytes(s, 0, 8192, 0x61, "the first range after the refused writes");
	for (uint32_t i = 0; i < 4096; i++)
		if (s->buf[8192 + i] != (uint8_t)(0x70 + i * 7))
			fail("write through the rebound window: byte %u", 8192 + i);
	check_bytes(s, 12288, LEN - 12288, (uint8_t)(0x61 + 12288 * 7), "after the window");
	ok("the rebound window took the write exactly; nothing else changed");
	/* 3. A type 1 window cannot be invalidated. */
	post_local_inv(s, 3, mw->rkey);
	expect(s, 3, IBV_WC_LOC_QP_OP_ERR, 0, "LOCAL_INV of a type 1 window");
	ok("IBV_WR_LOCAL_INV of a type 1 window: IBV_WC_LOC_QP_OP_ERR");
	restate(s);
	if (ibv_dereg_mr(s->mr) != EINVAL)
		fail("dereg_mr of an MR with a bound window");
	/* Neither may it be reregistered; a refused new translation leaves the MR as it was. */
	uint32_t lkey = s->mr->lkey, rkey = s->mr->rkey;
	void *addr = s->mr->addr;
	uint8_t *elsewhere = aligned_alloc(4096, LEN);
	if (ibv_rereg_mr(s->mr, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0,
			 IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND | IBV_ACCESS_REMOTE_READ) != IBV_REREG_MR_ERR_CMD ||
	    errno != EINVAL)
		fail("rereg_mr CHANGE_ACCESS of an MR with a bound window");
	if (ibv_rereg_mr(s->mr, IBV_REREG_MR_CHANGE_TRANSLATION, NULL, elsewhere, LEN, 0) != IBV_REREG_MR_ERR_CMD ||
	    errno != EINVAL)
		fail("rereg_mr CHANGE_TRANSLATION of an MR with a bound window");
	if (s->mr->lkey != lkey || s->mr->rkey != rkey || s->mr->addr != addr)
		fail("a refused rereg_mr changed the MR");
	ok("rereg_mr (access, translation) of an MR with a bound window: IBV_REREG_MR_ERR_CMD, EINVAL, MR unchanged");
	/* Unbound (zero length): the MR may go. */
	b.wr_id = 4;
	b.bind_info = (struct ibv_mw_bind_info){ 0 };
	if (ibv_bind_mw(s->qp, mw, &b))
		fail("ibv_bind_mw to unbind");
	expect(s, 4, IBV_WC_SUCCESS, IBV_WC_BIND_MW, "unbind");
	if (ibv_dealloc_mw(mw) || ibv_dealloc_mw(mw2) || ibv_dereg_mr(s->mr))
		fail("dealloc_mw/dereg_mr after unbinding");
	ok("dereg_mr while bound: EINVAL; unbound by a zero-length bind, then 0");
}

static void client_type1(struct side *s)
{
	struct win w = recv_win(s);
	if (rdma(s, 1, IBV_WR_RDMA_READ, 0, 4096, w.addr, w.rkey) != IBV_WC_SUCCESS)
		fail("read through the type 1 window");
	for (uint32_t i = 0; i < 4096; i++)
		if (s->buf[i] != (uint8_t)(0x61 + i * 7))
			fail("read through the window: byte %u", i);
	ok("read through a type 1 window: bytes exact");
	enum ibv_wc_status st = rdma(s, 2, IBV_WR_RDMA_WRITE, 0, 16, w.addr, w.rkey);
	if (st != IBV_WC_REM_ACCESS_ERR)
		fail("write through a read-only window: %s", ibv_wc_status_str(st));
	ok("write through a read-only window: IBV_WC_REM_ACCESS_ERR");
	restate(s);
	struct win w2 = recv_win(s);
	st = rdma(s, 3, IBV_WR_RDMA_READ, 0, 16, w.addr, w.rkey);
	if (st != IBV_WC_REM_ACCESS_ERR)
		fail("read through the key before the rebind: %s", ibv_wc_status_str(st));
	ok("after a rebind the previous key fails: IBV_WC_REM_ACCESS_ERR");
	restate(s);
	for (uint32_t i = 0; i < 4096; i++)
		s->buf[i] = (uint8_t)(0x70 + i * 7);
	if (rdma(s, 4, IBV_WR_RDMA_WRITE, 0, 4096, w2.addr, w2.rkey) != IBV_WC_SUCCESS)
		fail("write through the rebound window");
	ok("write through the rebound window's new key: success");
	say(s, 1);
	restate(s);
}

/* ---- rights ------------------------------------------------------------------------------ */

/* IB spec C10-73/C10-74: a window needs of its MR only MW_BIND and, to grant remote write or
 * atomics, local write; it may grant remote rights its MR lacks. The server's MR here is
 * LOCAL_WRITE | MW_BIND with no remote right, and the windows' flags hold LOCAL_WRITE beside
 * the remote ones, as rdma-core's tests/test_mr.py binds them (rxe and mlx5 take it; a
 * window grants only the remote rights). */

static void bind1(struct side *s, struct ibv_mw *mw, uint64_t id, struct ibv_mr *mr, uint64_t addr, uint64_t len,
		  unsigned acc)
{
	struct ibv_mw_bind b = { .wr_id = id, .send_flags = IBV_SEND_SIGNALED,
				 .bind_info = { .mr = mr, .addr = addr, .length = len, .mw_access_flags = acc } };
	if (ibv_bind_mw(s->qp, mw, &b))
		fail("ibv_bind_mw");
}

static void server_rights(struct side *s)
{
	uint64_t base = (uintptr_t)s->buf;
	/* 1. Type 1 (ibv_bind_mw), LOCAL_WRITE | REMOTE_WRITE over [0, 4096). */
	struct ibv_mw *mw1 = ibv_alloc_mw(s->pd, IBV_MW_TYPE_1);
	if (!mw1)
		fail("alloc_mw type 1");
	bind1(s, mw1, 1, s->mr, base, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	expect(s, 1, IBV_WC_SUCCESS, IBV_WC_BIND_MW, "type 1 bind granting REMOTE_WRITE");
	ok("type 1 window of LOCAL_WRITE | REMOTE_WRITE over an MR of LOCAL_WRITE | MW_BIND: IBV_WC_BIND_MW success");
	send_win(s, mw1->rkey, base, 4096);
	hear(s);
	check_bytes(s, 0, 4096, 0x11, "write through the type 1 window");
	check_untouched(s, 4096, LEN, "after the type 1 window");
	ok("the write through the type 1 window landed exactly in it");
	say(s, 1);
	restate(s);
	/* 2. Type 2 (IBV_WR_BIND_MW), LOCAL_WRITE | REMOTE_WRITE over [8192, 12288); then
	 *    IBV_WR_LOCAL_INV. */
	struct ibv_mw *mw2 = ibv_alloc_mw(s->pd, IBV_MW_TYPE_2);
	if (!mw2)
		fail("alloc_mw type 2");
	uint32_t k2 = ibv_inc_rkey(mw2->rkey);
	post_bind(s, 2, mw2, k2, s->mr, base + 8192, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	expect(s, 2, IBV_WC_SUCCESS, IBV_WC_BIND_MW, "type 2 bind granting REMOTE_WRITE");
	ok("type 2 window (IBV_WR_BIND_MW) of LOCAL_WRITE | REMOTE_WRITE over the same MR: IBV_WC_BIND_MW success");
	send_win(s, k2, base + 8192, 4096);
	hear(s);
	check_bytes(s, 8192, 4096, 0x22, "write through the type 2 window");
	check_untouched(s, 4096, 8192, "before the type 2 window");
	check_untouched(s, 12288, LEN, "after the type 2 window");
	post_local_inv(s, 3, k2);
	expect(s, 3, IBV_WC_SUCCESS, IBV_WC_LOCAL_INV, "local invalidate");
	say(s, 1);
	restate(s);
	check_bytes(s, 8192, 4096, 0x22, "the type 2 window after its invalidated key was used");
	/* 3. The same window again (ibv_wr_bind_mw), LOCAL_WRITE | REMOTE_READ over [16384,
	 *    20480): read only; then deallocated while bound. */
	fill(s, 16384, 4096, 0x33);
	uint32_t k3 = ibv_inc_rkey(k2);
	struct ibv_mw_bind_info bi = { .mr = s->mr, .addr = base + 16384, .length = 4096,
				       .mw_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ };
	ibv_wr_start(s->qpx);
	s->qpx->wr_id = 4;
	s->qpx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_bind_mw(s->qpx, mw2, k3, &bi);
	if (ibv_wr_complete(s->qpx))
		fail("wr_complete of wr_bind_mw");
	expect(s, 4, IBV_WC_SUCCESS, IBV_WC_BIND_MW, "ibv_wr_bind_mw granting REMOTE_READ");
	ok("type 2 window (ibv_wr_bind_mw) of LOCAL_WRITE | REMOTE_READ: IBV_WC_BIND_MW success");
	send_win(s, k3, base + 16384, 4096);
	restate(s);
	check_bytes(s, 16384, 4096, 0x33, "the read-only window after a write through it");
	ok("LOCAL_WRITE in a window's flags granted no remote write: its bytes unchanged");
	hear(s);
	if (ibv_dealloc_mw(mw2))
		fail("dealloc_mw of a bound type 2 window");
	say(s, 1);
	restate(s);
	ok("ibv_dealloc_mw of a bound type 2 window: 0, and its key reads nothing after");
	/* 4. An MR with MW_BIND alone (no local write): a window granting read binds; one
	 *    granting write or atomics does not (C10-74). */
	uint8_t *bare_buf = aligned_alloc(4096, 4096);
	for (int i = 0; i < 4096; i++)
		bare_buf[i] = (uint8_t)(0x44 + i * 7);
	struct ibv_mr *bare = ibv_reg_mr(s->pd, bare_buf, 4096, IBV_ACCESS_MW_BIND);
	if (!bare)
		fail("reg_mr with MW_BIND alone");
	bind1(s, mw1, 5, bare, (uintptr_t)bare_buf, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
	expect(s, 5, IBV_WC_SUCCESS, IBV_WC_BIND_MW, "readable window over an MR of MW_BIND alone");
	send_win(s, mw1->rkey, (uintptr_t)bare_buf, 4096);
	hear(s);
	ok("a readable window over an MR of MW_BIND alone binds");
	uint32_t kept = mw1->rkey;
	bind1(s, mw1, 6, bare, (uintptr_t)bare_buf, 4096, IBV_ACCESS_REMOTE_WRITE);
	expect(s, 6, IBV_WC_MW_BIND_ERR, 0, "writable window over an MR without local write");
	mw1->rkey = kept; /* the bind failed: the window keeps its key (rxe's rule for the app) */
	restate(s);
	bind1(s, mw1, 7, bare, (uintptr_t)bare_buf, 4096, IBV_ACCESS_REMOTE_ATOMIC);
	expect(s, 7, IBV_WC_MW_BIND_ERR, 0, "atomic window over an MR without local write");
	mw1->rkey = kept;
	restate(s);
	ok("a window granting REMOTE_WRITE or REMOTE_ATOMIC over an MR without LOCAL_WRITE: IBV_WC_MW_BIND_ERR");
	bind1(s, mw1, 8, NULL, 0, 0, 0);
	expect(s, 8, IBV_WC_SUCCESS, IBV_WC_BIND_MW, "unbind");
	if (ibv_dealloc_mw(mw1) || ibv_dereg_mr(bare))
		fail("dealloc_mw/dereg_mr");
}

static void client_rights(struct side *s)
{
	/* 1. */
	struct win w = recv_win(s);
	fill(s, 0, 4096, 0x11);
	if (rdma(s, 1, IBV_WR_RDMA_WRITE, 0, 4096, w.addr, w.rkey) != IBV_WC_SUCCESS)
		fail("write through a type 1 window granting REMOTE_WRITE over an MR without it");
	ok("write through the type 1 window (its MR has no remote access): success");
	say(s, 1);
	hear(s);
	enum ibv_wc_status st = rdma(s, 2, IBV_WR_RDMA_READ, 0, 16, w.addr, w.rkey);
	if (st != IBV_WC_REM_ACCESS_ERR)
		fail("read through a window of LOCAL_WRITE | REMOTE_WRITE: %s", ibv_wc_status_str(st));
	ok("read through a window of LOCAL_WRITE | REMOTE_WRITE: IBV_WC_REM_ACCESS_ERR");
	restate(s);
	/* 2. */
	w = recv_win(s);
	fill(s, 0, 4096, 0x22);
	if (rdma(s, 3, IBV_WR_RDMA_WRITE, 0, 4096, w.addr, w.rkey) != IBV_WC_SUCCESS)
		fail("write through the type 2 window");
	ok("write through the type 2 window: success");
	say(s, 1);
	hear(s);
	fill(s, 0, 16, 0x99);
	st = rdma(s, 4, IBV_WR_RDMA_WRITE, 0, 16, w.addr, w.rkey);
	if (st != IBV_WC_REM_ACCESS_ERR)
		fail("write through the locally invalidated key: %s", ibv_wc_status_str(st));
	ok("write through the locally invalidated key: IBV_WC_REM_ACCESS_ERR");
	restate(s);
	/* 3. */
	w = recv_win(s);
	memset(s->buf + 8192, 0, 4096);
	if (rdma(s, 5, IBV_WR_RDMA_READ, 8192, 4096, w.addr, w.rkey) != IBV_WC_SUCCESS)
		fail("read through the read-only type 2 window");
	for (uint32_t i = 0; i < 4096; i++)
		if (s->buf[8192 + i] != (uint8_t)(0x33 + i * 7))
			fail("read through the read-only window: byte %u is %#x", i, s->buf[8192 + i]);
	ok("read through the type 2 window of LOCAL_WRITE | REMOTE_READ: bytes exact");
	fill(s, 0, 16, 0x99);
	st = rdma(s, 6, IBV_WR_RDMA_WRITE, 0, 16, w.addr, w.rkey);
	if (st != IBV_WC_REM_ACCESS_ERR)
		fail("write through a window of LOCAL_WRITE | REMOTE_READ: %s", ibv_wc_status_str(st));
	ok("write through a window of LOCAL_WRITE | REMOTE_READ: IBV_WC_REM_ACCESS_ERR");
	restate(s);
	say(s, 1);
	hear(s);
	st = rdma(s, 7, IBV_WR_RDMA_READ, 8192, 16, w.addr, w.rkey);
	if (st != IBV_WC_REM_ACCESS_ERR)
		fail("read through a deallocated window's key: %s", ibv_wc_status_str(st));
	ok("read through a deallocated bound window's key: IBV_WC_REM_ACCESS_ERR");
	restate(s);
	/* 4. */
	w = recv_win(s);
	memset(s->buf, 0, 4096);
	if (rdma(s, 8, IBV_WR_RDMA_READ, 0, 4096, w.addr, w.rkey) != IBV_WC_SUCCESS)
		fail("read through a window over an MR of MW_BIND alone");
	for (uint32_t i = 0; i < 4096; i++)
		if (s->buf[i] != (uint8_t)(0x44 + i * 7))
			fail("read through the window over an MR of MW_BIND alone: byte %u", i);
	ok("read through a window over an MR of MW_BIND alone: bytes exact");
	say(s, 1);
	restate(s);
	restate(s);
}

int main(int argc, char **argv)
{
	setvbuf(stdout, NULL, _IOLBF, 0);
	struct side s = { 0 };
	int server = argc == 4 && !strcmp(argv[1], "server");
	if (!server && !(argc == 5 && !strcmp(argv[1], "client"))) {
		fprintf(stderr, "usage: mw_check server PORT MODE | client HOST PORT MODE\n");
		return 2;
	}
	const char *mode = argv[argc - 1];
	int far = !strncmp(mode, "far-", 4);
	const char *what = far ? mode + 4 : mode;
	s.sock = server ? listen_on(argv[2]) : connect_to(argv[2], argv[3]);
	setup(&s, server, far && server);
	if (!strcmp(what, "type2"))
		server ? server_type2(&s) : client_type2(&s);
	else if (!strcmp(what, "type1"))
		server ? server_type1(&s) : client_type1(&s);
	else if (!strcmp(what, "rights"))
		server ? server_rights(&s) : client_rights(&s);
	else
		fail("unknown mode %s", mode);
	/* The client leaves only after the server is done (its context's death would fail the
	 * server's QP). */
	if (server)
		say(&s, 9);
	else if (hear(&s) != 9)
		fail("out of step at the end");
	ok("%s %s done", server ? "server" : "client", mode);
	return 0;
}
