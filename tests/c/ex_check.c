/*
 * ex_check: the extended verbs API from two processes, built against libibverbs-dev and run
 * unmodified under `vrnic run` (server and client on separate vRNICs of one daemon). Both sides
 * make their QP with ibv_create_qp_ex and post only through the ibv_wr_* builders, make their CQ
 * with ibv_create_cq_ex and poll it only through ibv_start_poll/ibv_next_poll/ibv_end_poll and
 * the ibv_wc_read_* accessors (receives are still posted with ibv_post_recv: there is no other
 * way). The sides swap LID/QPN/address/rkey over a TCP socket, like ibv_rc_pingpong, then check
 * real outcomes byte for byte: what landed in memory, and every field of every completion.
 *
 *   ex_check server PORT MODE
 *   ex_check client HOST PORT MODE
 *
 * MODE rc: RDMA_WRITE, RDMA_WRITE_WITH_IMM, SEND_WITH_IMM from three SGEs, inline data (single
 *          and list, copied at the setter), RDMA_READ, both atomics, a mixed batch in one
 *          wr_start/wr_complete with an unsignaled WR, wr_abort and unsupported builders
 *          posting nothing, the server sending back, completion events on an extended CQ, and
 *          a hundred completions through a 16-entry CQ; completion timestamps nonzero, in
 *          order and on the host's CLOCK_MONOTONIC (the same clock as ibv_query_rt_values_ex).
 *      ud: SEND_WITH_IMM with ibv_wr_set_ud_addr (GRH space, source QP, immediate); a UD WR
 *          without an address fails wr_complete and posts nothing.
 *      aw: ATOMIC_WRITE (ibv_wr_atomic_write, IBA 1.5): device_cap_flags_ex advertises it; a
 *          batch of them lands exactly (the 8 bytes copied at the builder), in order after a
 *          WRITE; the server reads the word with 64-bit atomic loads while a thousand of them
 *          land and never sees a torn value; a misaligned one completes
 *          IBV_WC_REM_INV_REQ_ERR and one through an MR without remote write
 *          IBV_WC_REM_ACCESS_ERR (as rxe), storing nothing; ibv_post_send cannot carry one
 *          (EINVAL); the QPs work again after a reset.
 *
 * Prints "OK <check>" per passed check; exits 1 with "FAIL ..." on the first failure. Every
 * wait is bounded (POLL_SECONDS for a completion), so a lost completion fails instead of hanging.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <netdb.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "exchange.h"

#define BUF (64u << 10)
#define POLL_SECONDS 20
#define SENTINEL 0xEE
#define QKEY 0x11111111u
#define CQ_DEPTH 16

/* Regions of each side's registered buffer. */
#define TGT 0u      /* the peer writes here */
#define SRC 16384u  /* data we send or write from (and the peer reads): pat(side, offset) */
#define SRC_LEN 16384u
#define RCV 32832u  /* our receives and reads land here (after a gap of SENTINEL bytes) */
#define WORD 61440u /* the atomic target word */
#define OLD 61504u  /* atomic results */
#define AW 62000u   /* ATOMIC_WRITE targets (8-aligned: the buffer is page aligned) */

/* The kernel's IB_UVERBS_DEVICE_ATOMIC_WRITE (rdma/ib_user_verbs.h since Linux 6.2). */
#ifndef IB_UVERBS_DEVICE_ATOMIC_WRITE
#define IB_UVERBS_DEVICE_ATOMIC_WRITE (1ULL << 40)
#endif

struct info {
	uint32_t lid, qpn, rkey, pad;
	uint64_t addr;
};

struct side {
	int server, ud, aw, sock;
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_comp_channel *ch;
	struct ibv_cq_ex *cq;
	struct ibv_qp *qp;
	struct ibv_qp_ex *qx;
	uint8_t *buf;
	struct ibv_mr *mr;
	struct ibv_mr *mr_no_write; /* aw: the same buffer, remote read and atomics only */
	struct info me, peer;
	uint64_t last_ts;
};

/* One completion, every field read through the ibv_cq_ex accessors. */
struct cx {
	uint64_t wr_id, ts;
	enum ibv_wc_status status;
	enum ibv_wc_opcode opcode;
	uint32_t byte_len, imm, qp_num, src_qp, slid;
	unsigned flags;
};

static uint8_t pat(int who, uint32_t i) { return (uint8_t)(i * 7 + 13 + who * 51); }
static uint64_t now_ns(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (uint64_t)t.tv_sec * 1000000000u + t.tv_nsec;
}

/* ---- socket plumbing (as verbs_check.c) --------------------------------------------------- */

static void say(struct side *s, uint32_t v) { xfer(s->sock, &v, 4, 1); }
static uint32_t hear(struct side *s) { uint32_t v; xfer(s->sock, &v, 4, 0); return v; }

/* ---- setup -------------------------------------------------------------------------------- */

static const uint64_t RC_OPS = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM | IBV_QP_EX_WITH_RDMA_WRITE |
			       IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM | IBV_QP_EX_WITH_RDMA_READ |
			       IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP | IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD |
			       IBV_QP_EX_WITH_ATOMIC_WRITE;

static struct ibv_qp_init_attr_ex qp_attr(struct side *s, enum ibv_qp_type t, uint64_t ops)
{
	return (struct ibv_qp_init_attr_ex){
		.send_cq = ibv_cq_ex_to_cq(s->cq), .recv_cq = ibv_cq_ex_to_cq(s->cq), .qp_type = t,
		.cap = { .max_send_wr = 32, .max_recv_wr = 32, .max_send_sge = 4, .max_recv_sge = 2,
			 .max_inline_data = 128 },
		.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS, .pd = s->pd, .send_ops_flags = ops,
	};
}

/* What creation refuses, and which QPs have an extended view. */
static void creation_rules(struct side *s)
{
	struct ibv_cq_init_attr_ex wall = { .cqe = 4, .wc_flags = IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK };
	errno = 0;
	if (ibv_create_cq_ex(s->ctx, &wall) || errno != EOPNOTSUPP)
		fail("create_cq_ex with a wallclock timestamp: not EOPNOTSUPP");
	/* ATOMIC_WRITE exists on RC and XRC_SEND, not on UC or UD (no acknowledgements). */
	struct ibv_qp_init_attr_ex a = qp_attr(s, IBV_QPT_UC, IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_ATOMIC_WRITE);
	errno = 0;
	if (ibv_create_qp_ex(s->ctx, &a) || errno != EOPNOTSUPP)
		fail("create_qp_ex UC with ATOMIC_WRITE: not EOPNOTSUPP");
	a = qp_attr(s, IBV_QPT_UD, IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_ATOMIC_WRITE);
	errno = 0;
	if (ibv_create_qp_ex(s->ctx, &a) || errno != EOPNOTSUPP)
		fail("create_qp_ex UD with ATOMIC_WRITE: not EOPNOTSUPP");
	a = qp_attr(s, IBV_QPT_UD, IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_LOCAL_INV);
	errno = 0;
	if (ibv_create_qp_ex(s->ctx, &a) || errno != EOPNOTSUPP)
		fail("create_qp_ex UD with LOCAL_INV: not EOPNOTSUPP");
	a = qp_attr(s, IBV_QPT_UD, IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_RDMA_WRITE);
	errno = 0;
	if (ibv_create_qp_ex(s->ctx, &a) || errno != EOPNOTSUPP)
		fail("create_qp_ex UD with RDMA_WRITE: not EOPNOTSUPP");
	/* XRC send QPs exist (xrc_check.c); memory windows are not among their operations. */
	a = qp_attr(s, IBV_QPT_XRC_SEND, IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_BIND_MW);
	errno = 0;
	if (ibv_create_qp_ex(s->ctx, &a) || errno != EOPNOTSUPP)
		fail("create_qp_ex XRC_SEND with BIND_MW: not EOPNOTSUPP");
	a = qp_attr(s, IBV_QPT_XRC_SEND, IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_RDMA_READ | IBV_QP_EX_WITH_ATOMIC_WRITE);
	struct ibv_qp *xs = ibv_create_qp_ex(s->ctx, &a);
	if (!xs || xs->qp_type != IBV_QPT_XRC_SEND || !ibv_qp_to_qp_ex(xs))
		fail("create_qp_ex XRC_SEND with SEND, RDMA_READ and ATOMIC_WRITE (errno %d)", errno);
	if (ibv_destroy_qp(xs))
		fail("destroy the XRC send QP");
	a = qp_attr(s, IBV_QPT_RC, 0);
	a.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_MAX_TSO_HEADER;
	a.max_tso_header = 64;
	errno = 0;
	if (ibv_create_qp_ex(s->ctx, &a) || errno != EOPNOTSUPP)
		fail("create_qp_ex with MAX_TSO_HEADER: not EOPNOTSUPP");
	/* Created without SEND_OPS_FLAGS (through create_qp_ex: the mask is not PD alone): no
	 * extended view, as on mlx5. */
	a = qp_attr(s, IBV_QPT_RC, 0);
	a.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_CREATE_FLAGS;
	struct ibv_qp *plain = ibv_create_qp_ex(s->ctx, &a);
	if (!plain)
		fail("create_qp_ex with CREATE_FLAGS 0");
	if (ibv_qp_to_qp_ex(plain))
		fail("ibv_qp_to_qp_ex of a QP made without SEND_OPS_FLAGS is not NULL");
	if (ibv_destroy_qp(plain))
		fail("destroy_qp");
	ok("creation: wallclock CQ, UC and UD ATOMIC_WRITE, UD LOCAL_INV, UD RDMA_WRITE, XRC_SEND BIND_MW, TSO refused "
	   "with EOPNOTSUPP; RC and XRC_SEND take ATOMIC_WRITE; no qp_ex without SEND_OPS_FLAGS");
}

static const int QP_ACCESS = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC |
			     IBV_ACCESS_LOCAL_WRITE;

/* An RC QP in INIT to RTR and RTS, connected to the peer's. */
static void connect_rc(struct side *s)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_4096, .dest_qp_num = s->peer.qpn,
				 .rq_psn = 0, .max_dest_rd_atomic = 4, .min_rnr_timer = 12,
				 .ah_attr = { .dlid = s->peer.lid, .port_num = 1 } };
	if (ibv_modify_qp(s->qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
				     IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
		fail("modify RTR");
	a = (struct ibv_qp_attr){ .qp_state = IBV_QPS_RTS, .timeout = 14, .retry_cnt = 7, .rnr_retry = 7,
				  .sq_psn = 0, .max_rd_atomic = 4 };
	if (ibv_modify_qp(s->qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
				     IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
		fail("modify RTS");
}

/* After an error: the RC QP through RESET and INIT back to RTS (both sides do it, the server
 * first, then it says so). */
static void reconnect_rc(struct side *s)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_RESET };
	if (ibv_modify_qp(s->qp, &a, IBV_QP_STATE))
		fail("modify RESET");
	a = (struct ibv_qp_attr){ .qp_state = IBV_QPS_INIT, .port_num = 1, .qp_access_flags = QP_ACCESS };
	if (ibv_modify_qp(s->qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
		fail("modify INIT again");
	connect_rc(s);
}

static void setup(struct side *s)
{
	int n;
	struct ibv_device **list = ibv_get_device_list(&n);
	if (!list || n < 1)
		fail("no RDMA device");
	s->ctx = ibv_open_device(list[0]);
	if (!s->ctx)
		fail("open device");
	ibv_free_device_list(list);
	struct ibv_device_attr_ex dx;
	if (ibv_query_device_ex(s->ctx, NULL, &dx))
		fail("query_device_ex");
	if (dx.completion_timestamp_mask != UINT64_MAX || dx.hca_core_clock != 1000000)
		fail("query_device_ex: timestamp mask %#lx clock %lu kHz, expected a 64-bit ns clock",
		     (unsigned long)dx.completion_timestamp_mask, (unsigned long)dx.hca_core_clock);
	s->pd = ibv_alloc_pd(s->ctx);
	s->ch = ibv_create_comp_channel(s->ctx);
	if (!s->pd || !s->ch)
		fail("pd/channel");
	struct ibv_cq_init_attr_ex ca = { .cqe = CQ_DEPTH, .channel = s->ch,
					  .wc_flags = IBV_WC_STANDARD_FLAGS | IBV_WC_EX_WITH_COMPLETION_TIMESTAMP };
	s->cq = ibv_create_cq_ex(s->ctx, &ca);
	if (!s->cq)
		fail("create_cq_ex");
	creation_rules(s);
	struct ibv_qp_init_attr_ex qa =
		qp_attr(s, s->ud ? IBV_QPT_UD : IBV_QPT_RC,
			s->ud ? IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM : RC_OPS);
	s->qp = ibv_create_qp_ex(s->ctx, &qa);
	if (!s->qp)
		fail("create_qp_ex");
	s->qx = ibv_qp_to_qp_ex(s->qp);
	if (!s->qx || &s->qx->qp_base != s->qp)
		fail("ibv_qp_to_qp_ex");
	s->buf = aligned_alloc(4096, BUF);
	memset(s->buf, SENTINEL, BUF);
	for (uint32_t i = 0; i < SRC_LEN; i++)
		s->buf[SRC + i] = pat(s->server ? 2 : 1, i);
	*(uint64_t *)(s->buf + WORD) = 100;
	s->mr = ibv_reg_mr(s->pd, s->buf, BUF,
			   IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
				   IBV_ACCESS_REMOTE_ATOMIC);
	if (!s->mr)
		fail("reg_mr");
	if (s->aw) {
		s->mr_no_write = ibv_reg_mr(s->pd, s->buf, BUF,
					    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC);
		if (!s->mr_no_write)
			fail("reg_mr without remote write");
	}
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1, .qkey = QKEY,
				 .qp_access_flags = QP_ACCESS };
	if (ibv_modify_qp(s->qp, &a,
			  IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
				  (s->ud ? IBV_QP_QKEY : IBV_QP_ACCESS_FLAGS)))
		fail("modify INIT");
	struct ibv_port_attr pa;
	if (ibv_query_port(s->ctx, 1, &pa))
		fail("query_port");
	s->me = (struct info){ .lid = pa.lid, .qpn = s->qp->qp_num, .rkey = s->mr->rkey, .addr = (uintptr_t)s->buf };
	xfer(s->sock, &s->me, sizeof s->me, 1);
	xfer(s->sock, &s->peer, sizeof s->peer, 0);
	if (s->ud) {
		a = (struct ibv_qp_attr){ .qp_state = IBV_QPS_RTR };
		if (ibv_modify_qp(s->qp, &a, IBV_QP_STATE))
			fail("modify RTR");
		a = (struct ibv_qp_attr){ .qp_state = IBV_QPS_RTS, .sq_psn = 0 };
		if (ibv_modify_qp(s->qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN))
			fail("modify RTS");
		return;
	}
	connect_rc(s);
}

/* ---- polling through the extended CQ ------------------------------------------------------- */

/* Reads the current completion; its timestamp must be nonzero, no earlier than the last one of
 * this CQ, and a past instant of this host's CLOCK_MONOTONIC. */
static struct cx read_cur(struct side *s)
{
	struct ibv_cq_ex *cq = s->cq;
	struct cx c = { .wr_id = cq->wr_id, .status = cq->status, .opcode = ibv_wc_read_opcode(cq),
			.byte_len = ibv_wc_read_byte_len(cq), .imm = ibv_wc_read_imm_data(cq),
			.qp_num = ibv_wc_read_qp_num(cq), .src_qp = ibv_wc_read_src_qp(cq),
			.slid = ibv_wc_read_slid(cq), .flags = ibv_wc_read_wc_flags(cq),
			.ts = ibv_wc_read_completion_ts(cq) };
	uint64_t t = now_ns();
	if (!c.ts || c.ts < s->last_ts || c.ts > t || t - c.ts > 60000000000ull)
		fail("wr %lu: completion timestamp %lu (previous %lu, now %lu)", (unsigned long)c.wr_id,
		     (unsigned long)c.ts, (unsigned long)s->last_ts, (unsigned long)t);
	s->last_ts = c.ts;
	return c;
}

/* Collects n completions with start_poll/next_poll/end_poll. Returns the largest number one
 * start_poll..end_poll loop took (more than one means next_poll moved on to a later one). */
static int pollx(struct side *s, struct cx *out, int n)
{
	double deadline = now() + POLL_SECONDS;
	struct ibv_poll_cq_attr pa = {};
	int got = 0, most = 0;
	while (got < n) {
		int rc = ibv_start_poll(s->cq, &pa);
		if (rc == ENOENT) {
			if (now() > deadline)
				fail("%d of %d completions within %d s", got, n, POLL_SECONDS);
			continue;
		}
		if (rc)
			fail("start_poll: %d", rc);
		int loop = 0;
		do {
			out[got++] = read_cur(s);
			loop++;
		} while (got < n && (rc = ibv_next_poll(s->cq)) == 0);
		if (got < n && rc != ENOENT)
			fail("next_poll: %d", rc);
		ibv_end_poll(s->cq);
		most = loop > most ? loop : most;
	}
	return most;
}

/* Nothing completes within a while. */
static void expect_none(struct side *s, const char *what)
{
	usleep(200000);
	struct ibv_poll_cq_attr pa = {};
	int rc = ibv_start_poll(s->cq, &pa);
	if (rc != ENOENT) {
		if (rc == 0)
			fail("%s: a completion (wr %lu, %s)", what, (unsigned long)s->cq->wr_id,
			     ibv_wc_status_str(s->cq->status));
		fail("%s: start_poll %d", what, rc);
	}
}

/* One completion of ours: status, wr_id, opcode, our QP, and the length for kinds that have one. */
static struct cx expect1(struct side *s, uint64_t wr_id, enum ibv_wc_opcode op, int64_t len)
{
	struct cx c;
	pollx(s, &c, 1);
	if (c.status != IBV_WC_SUCCESS || c.wr_id != wr_id || c.opcode != op)
		fail("wr %lu %s opcode %d, expected wr %lu opcode %d", (unsigned long)c.wr_id,
		     ibv_wc_status_str(c.status), c.opcode, (unsigned long)wr_id, op);
	if (c.qp_num != s->qp->qp_num)
		fail("wr %lu: qp_num %u, expected %u", (unsigned long)wr_id, c.qp_num, s->qp->qp_num);
	if (len >= 0 && c.byte_len != (uint32_t)len)
		fail("wr %lu: byte_len %u, expected %ld", (unsigned long)wr_id, c.byte_len, (long)len);
	return c;
}

/* A receive completion from the peer: opcode, length, immediate (0: none), source. */
static void check_recv(struct side *s, struct cx *c, uint64_t wr_id, enum ibv_wc_opcode op, uint32_t len,
		       uint32_t imm)
{
	if (c->status != IBV_WC_SUCCESS || c->wr_id != wr_id || c->opcode != op || c->byte_len != len)
		fail("receive wr %lu %s opcode %d len %u, expected wr %lu opcode %d len %u", (unsigned long)c->wr_id,
		     ibv_wc_status_str(c->status), c->opcode, c->byte_len, (unsigned long)wr_id, op, len);
	if (imm && (!(c->flags & IBV_WC_WITH_IMM) || ntohl(c->imm) != imm))
		fail("receive wr %lu: imm %#x flags %#x, expected imm %#x", (unsigned long)wr_id, ntohl(c->imm),
		     c->flags, imm);
	if (!imm && (c->flags & IBV_WC_WITH_IMM))
		fail("receive wr %lu: IBV_WC_WITH_IMM without immediate data", (unsigned long)wr_id);
	if (c->qp_num != s->qp->qp_num || c->src_qp != s->peer.qpn || c->slid != s->peer.lid)
		fail("receive wr %lu: qp_num %u src_qp %u slid %u, expected %u %u %u", (unsigned long)wr_id,
		     c->qp_num, c->src_qp, c->slid, s->qp->qp_num, s->peer.qpn, s->peer.lid);
}

static void post_recv(struct side *s, uint64_t wr_id, uint32_t off, uint32_t len)
{
	struct ibv_sge sge = { .addr = (uintptr_t)s->buf + off, .length = len, .lkey = s->mr->lkey };
	struct ibv_recv_wr wr = { .wr_id = wr_id, .sg_list = &sge, .num_sge = 1 }, *bad;
	if (ibv_post_recv(s->qp, &wr, &bad))
		fail("post_recv");
}

/* `len` bytes at `off` of our buffer equal the peer's (`who`) pattern from `from`. */
static void check_pat(struct side *s, uint32_t off, uint32_t len, int who, uint32_t from, const char *what)
{
	for (uint32_t i = 0; i < len; i++)
		if (s->buf[off + i] != pat(who, from + i))
			fail("%s: byte %u is %#x, expected %#x", what, i, s->buf[off + i], pat(who, from + i));
}

/* As check_pat, and the bytes just before and after are untouched. */
static void check_bytes(struct side *s, uint32_t off, uint32_t len, int who, uint32_t from, const char *what)
{
	check_pat(s, off, len, who, from, what);
	if (off > 0 && s->buf[off - 1] != SENTINEL)
		fail("%s: the byte before changed", what);
	if (s->buf[off + len] != SENTINEL)
		fail("%s: the byte after changed", what);
}

static void check_untouched(struct side *s, uint32_t off, uint32_t len, const char *what)
{
	for (uint32_t i = 0; i < len; i++)
		if (s->buf[off + i] != SENTINEL)
			fail("%s: byte %u changed", what, i);
}

static uint64_t raw_clock(struct side *s)
{
	struct ibv_values_ex v = { .comp_mask = IBV_VALUES_MASK_RAW_CLOCK };
	if (ibv_query_rt_values_ex(s->ctx, &v) || !(v.comp_mask & IBV_VALUES_MASK_RAW_CLOCK))
		fail("ibv_query_rt_values_ex");
	return (uint64_t)v.raw_clock.tv_sec * 1000000000u + v.raw_clock.tv_nsec;
}

/* ---- the rc mode ---------------------------------------------------------------------------- */

static void client_rc(struct side *s)
{
	struct ibv_qp_ex *x = s->qx;
	uint32_t lkey = s->mr->lkey, rkey = s->peer.rkey;
	uint64_t raddr = s->peer.addr, laddr = (uintptr_t)s->buf;

	/* RDMA_WRITE, timed against the raw clock. */
	uint64_t t0 = raw_clock(s);
	ibv_wr_start(x);
	x->wr_id = 1;
	x->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_write(x, rkey, raddr + TGT + 3);
	ibv_wr_set_sge(x, lkey, laddr + SRC + 1, 5000);
	if (ibv_wr_complete(x))
		fail("wr_complete write");
	struct cx c = expect1(s, 1, IBV_WC_RDMA_WRITE, 5000);
	uint64_t t1 = raw_clock(s);
	if (c.ts < t0 || c.ts > t1)
		fail("write completion stamped %lu, outside the raw clock's %lu..%lu", (unsigned long)c.ts,
		     (unsigned long)t0, (unsigned long)t1);
	ok("wr_rdma_write: completion opcode, length, qp_num; stamped between two raw clock reads");
	say(s, 1);
	hear(s);

	/* RDMA_WRITE_WITH_IMM. */
	hear(s);
	x->wr_id = 2;
	ibv_wr_start(x);
	ibv_wr_rdma_write_imm(x, rkey, raddr + TGT + 8000, htonl(0x12345678));
	ibv_wr_set_sge(x, lkey, laddr + SRC + 100, 1000);
	if (ibv_wr_complete(x))
		fail("wr_complete write_imm");
	expect1(s, 2, IBV_WC_RDMA_WRITE, 1000);
	hear(s);
	ok("wr_rdma_write_imm");

	/* SEND_WITH_IMM gathered from three SGEs. */
	hear(s);
	struct ibv_sge three[3] = { { laddr + SRC, 7, lkey }, { laddr + SRC + 1001, 4096, lkey },
				    { laddr + SRC + 9000, 13, lkey } };
	ibv_wr_start(x);
	x->wr_id = 3;
	ibv_wr_send_imm(x, htonl(0xabcdef01));
	ibv_wr_set_sge_list(x, 3, three);
	if (ibv_wr_complete(x))
		fail("wr_complete send_imm");
	expect1(s, 3, IBV_WC_SEND, 4116);
	hear(s);
	ok("wr_send_imm with wr_set_sge_list of 3 SGEs");

	/* Inline data from unregistered memory, copied by the setter (clobbered before
	 * wr_complete); then IBV_SEND_INLINE in wr_flags with wr_set_sge sends the SGE's bytes
	 * (the flag means nothing to the builders, as on mlx5). */
	hear(s);
	uint8_t one[100], a[5], b[17], d[1];
	for (uint32_t i = 0; i < sizeof one; i++)
		one[i] = pat(3, i);
	for (uint32_t i = 0; i < sizeof a; i++)
		a[i] = pat(4, i);
	for (uint32_t i = 0; i < sizeof b; i++)
		b[i] = pat(4, sizeof a + i);
	d[0] = pat(4, sizeof a + sizeof b);
	struct ibv_data_buf list[3] = { { a, sizeof a }, { b, sizeof b }, { d, 1 } };
	ibv_wr_start(x);
	x->wr_id = 4;
	ibv_wr_send(x);
	ibv_wr_set_inline_data(x, one, sizeof one);
	memset(one, 0, sizeof one);
	if (ibv_wr_complete(x))
		fail("wr_complete inline");
	expect1(s, 4, IBV_WC_SEND, 100);
	ibv_wr_start(x);
	x->wr_id = 5;
	ibv_wr_send_imm(x, htonl(5));
	ibv_wr_set_inline_data_list(x, 3, list);
	memset(a, 0, sizeof a);
	memset(b, 0, sizeof b);
	if (ibv_wr_complete(x))
		fail("wr_complete inline list");
	expect1(s, 5, IBV_WC_SEND, 23);
	ibv_wr_start(x);
	x->wr_id = 6;
	x->wr_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
	ibv_wr_send(x);
	ibv_wr_set_sge(x, lkey, laddr + SRC + 200, 300);
	if (ibv_wr_complete(x))
		fail("wr_complete sge with the inline flag");
	expect1(s, 6, IBV_WC_SEND, 300);
	x->wr_flags = IBV_SEND_SIGNALED;
	hear(s);
	ok("wr_set_inline_data, wr_set_inline_data_list (copied at the setter); INLINE flag with an SGE");

	/* RDMA_READ scattered over two SGEs. */
	struct ibv_sge two[2] = { { laddr + RCV + 3, 2000, lkey }, { laddr + RCV + 4000, 4000, lkey } };
	ibv_wr_start(x);
	x->wr_id = 7;
	ibv_wr_rdma_read(x, rkey, raddr + SRC + 5);
	ibv_wr_set_sge_list(x, 2, two);
	if (ibv_wr_complete(x))
		fail("wr_complete read");
	expect1(s, 7, IBV_WC_RDMA_READ, 6000);
	check_bytes(s, RCV + 3, 2000, 2, 5, "read, first SGE");
	check_bytes(s, RCV + 4000, 4000, 2, 2005, "read, second SGE");
	memset(s->buf + RCV, SENTINEL, 9000);
	ok("wr_rdma_read into two SGEs: byte for byte");

	/* Both atomics, one batch: 100 + 5 -> 105; 105 == 105 -> 7; 1 != 7 (no swap). */
	uint64_t *old = (uint64_t *)(s->buf + OLD);
	ibv_wr_start(x);
	x->wr_id = 8;
	ibv_wr_atomic_fetch_add(x, rkey, raddr + WORD, 5);
	ibv_wr_set_sge(x, lkey, laddr + OLD, 8);
	x->wr_id = 9;
	ibv_wr_atomic_cmp_swp(x, rkey, raddr + WORD, 105, 7);
	ibv_wr_set_sge(x, lkey, laddr + OLD + 8, 8);
	x->wr_id = 10;
	ibv_wr_atomic_cmp_swp(x, rkey, raddr + WORD, 1, 9);
	ibv_wr_set_sge(x, lkey, laddr + OLD + 16, 8);
	if (ibv_wr_complete(x))
		fail("wr_complete atomics");
	expect1(s, 8, IBV_WC_FETCH_ADD, 8);
	expect1(s, 9, IBV_WC_COMP_SWAP, 8);
	expect1(s, 10, IBV_WC_COMP_SWAP, 8);
	if (old[0] != 100 || old[1] != 105 || old[2] != 7)
		fail("atomics returned %lu %lu %lu, expected 100 105 7", (unsigned long)old[0],
		     (unsigned long)old[1], (unsigned long)old[2]);
	say(s, 1);
	hear(s);
	ok("wr_atomic_fetch_add, wr_atomic_cmp_swp (hit and miss): returned old values");

	/* A batch of five mixed WRs, one unsignaled. */
	hear(s);
	uint8_t tail[40];
	for (uint32_t i = 0; i < sizeof tail; i++)
		tail[i] = pat(5, i);
	ibv_wr_start(x);
	x->wr_id = 70;
	ibv_wr_rdma_write(x, rkey, raddr + TGT + 12000);
	ibv_wr_set_sge(x, lkey, laddr + SRC + 3000, 777);
	x->wr_id = 71;
	ibv_wr_rdma_write_imm(x, rkey, raddr + TGT + 13000, htonl(71));
	ibv_wr_set_sge(x, lkey, laddr + SRC + 4000, 55);
	x->wr_id = 72;
	x->wr_flags = 0;
	ibv_wr_send(x);
	ibv_wr_set_sge(x, lkey, laddr + SRC + 5000, 1234);
	x->wr_id = 73;
	x->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_send_imm(x, htonl(73));
	ibv_wr_set_inline_data(x, tail, sizeof tail);
	x->wr_id = 74;
	ibv_wr_rdma_read(x, rkey, raddr + SRC + 100);
	ibv_wr_set_sge(x, lkey, laddr + RCV + 10000, 64);
	if (ibv_wr_complete(x))
		fail("wr_complete batch of five");
	hear(s); /* the server has its three receives */
	usleep(100000);
	struct cx four[4];
	int most = pollx(s, four, 4);
	static const uint64_t want_ids[4] = { 70, 71, 73, 74 };
	static const enum ibv_wc_opcode want_ops[4] = { IBV_WC_RDMA_WRITE, IBV_WC_RDMA_WRITE, IBV_WC_SEND,
							 IBV_WC_RDMA_READ };
	for (int i = 0; i < 4; i++)
		if (four[i].status != IBV_WC_SUCCESS || four[i].wr_id != want_ids[i] || four[i].opcode != want_ops[i])
			fail("batch completion %d: wr %lu %s opcode %d", i, (unsigned long)four[i].wr_id,
			     ibv_wc_status_str(four[i].status), four[i].opcode);
	if (most < 2)
		fail("next_poll never moved on to a second completion");
	expect_none(s, "the unsignaled WR of the batch");
	check_bytes(s, RCV + 10000, 64, 2, 100, "batch read");
	memset(s->buf + RCV + 10000, SENTINEL, 64);
	say(s, 1);
	ok("one batch of write, write_imm, unsignaled send, send_imm inline, read: 4 completions in "
	   "order through start_poll/next_poll (%d in one loop)", most);

	/* wr_abort posts nothing; neither does a batch with an unsupported builder. */
	hear(s);
	ibv_wr_start(x);
	x->wr_id = 80;
	ibv_wr_rdma_write(x, rkey, raddr + TGT + 14000);
	ibv_wr_set_sge(x, lkey, laddr + SRC, 100);
	x->wr_id = 81;
	ibv_wr_send(x);
	ibv_wr_set_sge(x, lkey, laddr + SRC, 10);
	ibv_wr_abort(x);
	expect_none(s, "after wr_abort");
	say(s, 1);
	hear(s);
	ok("wr_abort: nothing posted");
	static const char *names[3] = { "wr_atomic_write then a data setter", "wr_send_tso", "wr_set_xrc_srqn" };
	static const uint64_t eight = 8;
	for (int k = 0; k < 3; k++) {
		ibv_wr_start(x);
		x->wr_id = 82;
		ibv_wr_rdma_write(x, rkey, raddr + TGT + 14000);
		ibv_wr_set_sge(x, lkey, laddr + SRC, 100);
		if (k == 0) {
			/* Its data is the 8 bytes the builder took: no setter applies to it. */
			ibv_wr_atomic_write(x, rkey, raddr + TGT + 14000, &eight);
			ibv_wr_set_sge(x, lkey, laddr + SRC, 8);
		} else if (k == 1) {
			ibv_wr_send_tso(x, (void *)&eight, 8, 1024);
			ibv_wr_set_sge(x, lkey, laddr + SRC, 10);
		} else {
			x->wr_id = 83;
			ibv_wr_send(x);
			ibv_wr_set_xrc_srqn(x, 7);
			ibv_wr_set_sge(x, lkey, laddr + SRC, 10);
		}
		int rc = ibv_wr_complete(x);
		if (rc != EOPNOTSUPP && rc != EINVAL)
			fail("a batch with %s: wr_complete returned %d", names[k], rc);
		expect_none(s, names[k]);
		ok("a batch with %s: wr_complete %s, nothing posted", names[k], strerror(rc));
	}
	say(s, 1);
	hear(s);
	/* The QP still works. */
	ibv_wr_start(x);
	x->wr_id = 84;
	ibv_wr_send(x);
	ibv_wr_set_sge(x, lkey, laddr + SRC + 50, 10);
	if (ibv_wr_complete(x))
		fail("wr_complete after the failed batches");
	expect1(s, 84, IBV_WC_SEND, 10);
	hear(s);
	ok("the QP works after aborted and failed batches");

	/* The server sends back through its own ibv_wr_* table. */
	memset(s->buf + RCV, SENTINEL, 4096);
	post_recv(s, 900, RCV + 1, 2048);
	say(s, 1);
	struct cx r;
	pollx(s, &r, 1);
	check_recv(s, &r, 900, IBV_WC_RECV, 999, 90);
	check_bytes(s, RCV + 1, 999, 2, 7, "the server's send_imm");
	hear(s);
	ok("receive of the server's wr_send_imm: opcode, imm, length, qp_num, src_qp, slid, bytes");

	/* A completion event on the extended CQ. */
	if (ibv_req_notify_cq(ibv_cq_ex_to_cq(s->cq), 0))
		fail("req_notify_cq");
	ibv_wr_start(x);
	x->wr_id = 100;
	ibv_wr_rdma_write(x, rkey, raddr + TGT + 15000);
	ibv_wr_set_sge(x, lkey, laddr + SRC, 16);
	if (ibv_wr_complete(x))
		fail("wr_complete");
	struct pollfd p = { .fd = s->ch->fd, .events = POLLIN };
	if (poll(&p, 1, POLL_SECONDS * 1000) != 1)
		fail("no completion event");
	struct ibv_cq *ev_cq;
	void *ev_ctx;
	if (ibv_get_cq_event(s->ch, &ev_cq, &ev_ctx) || ev_cq != ibv_cq_ex_to_cq(s->cq))
		fail("get_cq_event");
	ibv_ack_cq_events(ev_cq, 1);
	struct ibv_poll_cq_attr pa = {};
	if (ibv_start_poll(s->cq, &pa))
		fail("start_poll after a completion event found nothing");
	struct cx e = read_cur(s);
	ibv_end_poll(s->cq);
	if (e.wr_id != 100 || e.status != IBV_WC_SUCCESS)
		fail("event completion wr %lu", (unsigned long)e.wr_id);
	ok("completion event on an extended CQ (channel, req_notify, get_cq_event), then start_poll");
	say(s, 1);

	/* A hundred completions through a 16-entry CQ: end_poll frees the slots. */
	for (int i = 0; i < 100; i++) {
		ibv_wr_start(x);
		x->wr_id = 1000 + i;
		ibv_wr_rdma_write(x, rkey, raddr + TGT + 15200 + i);
		ibv_wr_set_sge(x, lkey, laddr + SRC + i, 1);
		if (ibv_wr_complete(x))
			fail("wr_complete %d", i);
		expect1(s, 1000 + i, IBV_WC_RDMA_WRITE, 1);
	}
	say(s, 1);
	hear(s);
	ok("100 completions through a %d-entry CQ, timestamps in order", CQ_DEPTH);
}

static void server_rc(struct side *s)
{
	struct ibv_qp_ex *x = s->qx;
	struct cx c;

	hear(s);
	check_bytes(s, TGT + 3, 5000, 1, 1, "write");
	say(s, 1);

	post_recv(s, 200, RCV, 64);
	say(s, 1);
	pollx(s, &c, 1);
	check_recv(s, &c, 200, IBV_WC_RECV_RDMA_WITH_IMM, 1000, 0x12345678);
	check_bytes(s, TGT + 8000, 1000, 1, 100, "write_imm");
	check_untouched(s, RCV, 64, "write_imm's receive buffer");
	say(s, 1);
	ok("receive of wr_rdma_write_imm: opcode, imm, length, qp_num, src_qp, slid; bytes");

	post_recv(s, 300, RCV + 1, 9000);
	say(s, 1);
	pollx(s, &c, 1);
	check_recv(s, &c, 300, IBV_WC_RECV, 4116, 0xabcdef01);
	for (uint32_t i = 0; i < 4116; i++) {
		uint32_t from = i < 7 ? i : i < 7 + 4096 ? 1001 + (i - 7) : 9000 + (i - 7 - 4096);
		if (s->buf[RCV + 1 + i] != pat(1, from))
			fail("send from 3 SGEs: byte %u wrong", i);
	}
	if (s->buf[RCV] != SENTINEL || s->buf[RCV + 1 + 4116] != SENTINEL)
		fail("send from 3 SGEs: a byte around the message changed");
	memset(s->buf + RCV, SENTINEL, 9001);
	say(s, 1);
	ok("receive of wr_send_imm from 3 SGEs: the three pieces in order");

	post_recv(s, 400, RCV, 512);
	post_recv(s, 401, RCV + 512, 512);
	post_recv(s, 402, RCV + 1024, 512);
	say(s, 1);
	struct cx three[3];
	pollx(s, three, 3);
	check_recv(s, &three[0], 400, IBV_WC_RECV, 100, 0);
	check_recv(s, &three[1], 401, IBV_WC_RECV, 23, 5);
	check_recv(s, &three[2], 402, IBV_WC_RECV, 300, 0);
	check_bytes(s, RCV, 100, 3, 0, "inline data");
	check_bytes(s, RCV + 512, 23, 4, 0, "inline data list");
	check_bytes(s, RCV + 1024, 300, 1, 200, "SGE with the inline flag");
	memset(s->buf + RCV, SENTINEL, 2048);
	say(s, 1);
	ok("receives of inline data, an inline list, and an SGE send with the inline flag");

	hear(s);
	uint64_t word = *(volatile uint64_t *)(s->buf + WORD);
	if (word != 7)
		fail("atomic word is %lu, expected 7", (unsigned long)word);
	say(s, 1);
	ok("atomics: the remote word is 7");

	post_recv(s, 700, RCV, 4096);
	post_recv(s, 701, RCV + 4096, 4096);
	post_recv(s, 702, RCV + 8192, 4096);
	say(s, 1);
	pollx(s, three, 3);
	check_recv(s, &three[0], 700, IBV_WC_RECV_RDMA_WITH_IMM, 55, 71);
	check_recv(s, &three[1], 701, IBV_WC_RECV, 1234, 0);
	check_recv(s, &three[2], 702, IBV_WC_RECV, 40, 73);
	check_bytes(s, TGT + 12000, 777, 1, 3000, "batch write");
	check_bytes(s, TGT + 13000, 55, 1, 4000, "batch write_imm");
	check_bytes(s, RCV + 4096, 1234, 1, 5000, "batch send");
	check_bytes(s, RCV + 8192, 40, 5, 0, "batch send_imm inline");
	memset(s->buf + RCV, SENTINEL, 12288);
	say(s, 1);
	hear(s);
	ok("receives of the batch: write_imm, send, send_imm in order; write bytes");

	post_recv(s, 800, RCV, 64);
	say(s, 1);
	hear(s);
	check_untouched(s, TGT + 14000, 100, "aborted write");
	expect_none(s, "receive after wr_abort");
	say(s, 1);
	hear(s);
	check_untouched(s, TGT + 14000, 100, "write in a failed batch");
	expect_none(s, "receive after failed batches");
	say(s, 1);
	pollx(s, &c, 1);
	check_recv(s, &c, 800, IBV_WC_RECV, 10, 0);
	check_bytes(s, RCV, 10, 1, 50, "send after the failed batches");
	say(s, 1);
	ok("aborted and failed batches changed nothing here; the next send arrived");

	hear(s);
	ibv_wr_start(x);
	x->wr_id = 90;
	x->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_send_imm(x, htonl(90));
	ibv_wr_set_sge(x, s->mr->lkey, (uintptr_t)s->buf + SRC + 7, 999);
	if (ibv_wr_complete(x))
		fail("wr_complete server send_imm");
	expect1(s, 90, IBV_WC_SEND, 999);
	say(s, 1);
	ok("server wr_send_imm");

	hear(s);
	/* Meanwhile the client wrote 100 single bytes. */
	hear(s);
	for (int i = 0; i < 100; i++)
		if (s->buf[TGT + 15200 + i] != pat(1, i))
			fail("write %d of 100: wrong byte", i);
	say(s, 1);
	ok("100 single-byte writes landed");
}

/* ---- the ud mode ---------------------------------------------------------------------------- */

static void client_ud(struct side *s)
{
	struct ibv_qp_ex *x = s->qx;
	struct ibv_ah_attr aa = { .dlid = s->peer.lid, .port_num = 1 };
	struct ibv_ah *ah = ibv_create_ah(s->pd, &aa);
	if (!ah)
		fail("create_ah");
	hear(s);
	/* No address: the batch fails and posts nothing. */
	ibv_wr_start(x);
	x->wr_id = 1;
	x->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_send(x);
	ibv_wr_set_sge(x, s->mr->lkey, (uintptr_t)s->buf + SRC, 100);
	int rc = ibv_wr_complete(x);
	if (rc != EINVAL)
		fail("a UD WR without wr_set_ud_addr: wr_complete returned %d", rc);
	expect_none(s, "UD WR without an address");
	ok("a UD WR without wr_set_ud_addr: EINVAL, nothing posted");
	say(s, 1);
	hear(s);
	ibv_wr_start(x);
	x->wr_id = 2;
	ibv_wr_send_imm(x, htonl(0x5d));
	ibv_wr_set_ud_addr(x, ah, s->peer.qpn, QKEY);
	ibv_wr_set_sge(x, s->mr->lkey, (uintptr_t)s->buf + SRC + 11, 1500);
	x->wr_id = 3;
	ibv_wr_send(x);
	ibv_wr_set_ud_addr(x, ah, s->peer.qpn, QKEY);
	ibv_wr_set_inline_data(x, s->buf + SRC + 20, 64);
	if (ibv_wr_complete(x))
		fail("wr_complete UD");
	struct cx two[2];
	pollx(s, two, 2);
	for (int i = 0; i < 2; i++)
		if (two[i].status != IBV_WC_SUCCESS || two[i].wr_id != (uint64_t)(2 + i) || two[i].opcode != IBV_WC_SEND)
			fail("UD send completion %d: wr %lu %s", i, (unsigned long)two[i].wr_id,
			     ibv_wc_status_str(two[i].status));
	hear(s);
	ok("wr_send_imm and an inline wr_send with wr_set_ud_addr");
	if (ibv_destroy_ah(ah))
		fail("destroy_ah");
}

static void server_ud(struct side *s)
{
	post_recv(s, 10, RCV, 40 + 2048);
	post_recv(s, 11, RCV + 4096, 40 + 2048);
	say(s, 1);
	hear(s);
	expect_none(s, "receive of a UD WR without an address");
	say(s, 1);
	struct cx two[2];
	pollx(s, two, 2);
	/* UD receives count the 40 bytes of GRH space. */
	check_recv(s, &two[0], 10, IBV_WC_RECV, 40 + 1500, 0x5d);
	check_recv(s, &two[1], 11, IBV_WC_RECV, 40 + 64, 0);
	for (int i = 0; i < 2; i++)
		if (two[i].flags & IBV_WC_GRH)
			fail("UD receive %d: IBV_WC_GRH without a global route", i);
	/* The GRH space before the payload is the device's to fill or not. */
	check_pat(s, RCV + 40, 1500, 1, 11, "UD send_imm");
	check_pat(s, RCV + 4096 + 40, 64, 1, 20, "UD inline send");
	if (s->buf[RCV + 40 + 1500] != SENTINEL || s->buf[RCV + 4096 + 40 + 64] != SENTINEL)
		fail("UD receive: a byte after the message changed");
	say(s, 1);
	ok("UD receives: opcode, imm, length with GRH space, src_qp, slid, bytes");
}


/* ---- the aw mode (ATOMIC_WRITE) ------------------------------------------------------------- */

/* Two 64-bit values with no byte in common, so that a torn word shows as neither. */
#define AW_A 0x0123456789abcdefull
#define AW_B 0xfedcba9876543210ull
#define AW_HAMMER 1000

/* One completion of ours with this status (an error: opcode unreliable, not checked). */
static void expect_status(struct side *s, uint64_t wr_id, enum ibv_wc_status st)
{
	struct cx c;
	pollx(s, &c, 1);
	if (c.wr_id != wr_id || c.status != st)
		fail("wr %lu %s, expected wr %lu %s", (unsigned long)c.wr_id, ibv_wc_status_str(c.status),
		     (unsigned long)wr_id, ibv_wc_status_str(st));
}

static void client_aw(struct side *s)
{
	struct ibv_qp_ex *x = s->qx;
	uint32_t lkey = s->mr->lkey, rkey = s->peer.rkey;
	uint64_t raddr = s->peer.addr, laddr = (uintptr_t)s->buf;
	uint32_t rkey_no_write = hear(s);

	struct ibv_device_attr_ex dx;
	if (ibv_query_device_ex(s->ctx, NULL, &dx))
		fail("query_device_ex");
	if (!(dx.device_cap_flags_ex & IB_UVERBS_DEVICE_ATOMIC_WRITE))
		fail("device_cap_flags_ex %#llx lacks IB_UVERBS_DEVICE_ATOMIC_WRITE",
		     (unsigned long long)dx.device_cap_flags_ex);
	ok("device_cap_flags_ex has IB_UVERBS_DEVICE_ATOMIC_WRITE (bit 40)");

	/* A WRITE of 64 bytes, then three ATOMIC_WRITEs in one batch, their data copied at the
	 * builder (the source is clobbered before wr_complete). */
	uint64_t v[3] = { 0x1111222233334444ull, 0x5555666677778888ull, 0x99990000aaaabbbbull };
	uint64_t src;
	ibv_wr_start(x);
	x->wr_id = 1;
	x->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_write(x, rkey, raddr + AW + 64);
	ibv_wr_set_sge(x, lkey, laddr + SRC, 64);
	for (int i = 0; i < 3; i++) {
		x->wr_id = 2 + i;
		src = v[i];
		ibv_wr_atomic_write(x, rkey, raddr + AW + (i == 2 ? 24 : 8 * i), &src);
		src = 0;
	}
	if (ibv_wr_complete(x))
		fail("wr_complete of a WRITE and three ATOMIC_WRITEs");
	expect1(s, 1, IBV_WC_RDMA_WRITE, 64);
	for (int i = 0; i < 3; i++)
		expect1(s, 2 + i, IBV_WC_ATOMIC_WRITE, -1);
	say(s, 1);
	hear(s);
	ok("three wr_atomic_write in a batch after a WRITE: IBV_WC_SUCCESS, IBV_WC_ATOMIC_WRITE, in order");

	/* A thousand ATOMIC_WRITEs of two values to one word while the server reads it. */
	hear(s);
	for (int i = 0; i < AW_HAMMER; i += 10) {
		ibv_wr_start(x);
		for (int j = 0; j < 10; j++) {
			x->wr_id = 100 + i + j;
			x->wr_flags = j == 9 ? IBV_SEND_SIGNALED : 0;
			src = (i + j) % 2 ? AW_B : AW_A;
			ibv_wr_atomic_write(x, rkey, raddr + AW + 128, &src);
		}
		if (ibv_wr_complete(x))
			fail("wr_complete of ten ATOMIC_WRITEs");
		expect1(s, 100 + i + 9, IBV_WC_ATOMIC_WRITE, -1);
	}
	x->wr_flags = IBV_SEND_SIGNALED;
	say(s, 1);
	hear(s);
	ok("%d ATOMIC_WRITEs to one word", AW_HAMMER);

	/* ibv_post_send has no member for the 8 bytes: EINVAL, nothing posted. */
	struct ibv_sge sge = { laddr + SRC, 8, lkey };
	struct ibv_send_wr wr = { .wr_id = 300, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_ATOMIC_WRITE,
				  .send_flags = IBV_SEND_SIGNALED,
				  .wr.rdma = { .remote_addr = raddr + AW + 192, .rkey = rkey } };
	struct ibv_send_wr *bad = NULL;
	int rc = ibv_post_send(s->qp, &wr, &bad);
	if (rc != EINVAL || bad != &wr)
		fail("ibv_post_send with IBV_WR_ATOMIC_WRITE returned %d", rc);
	expect_none(s, "ibv_post_send of an ATOMIC_WRITE");
	ok("ibv_post_send with IBV_WR_ATOMIC_WRITE: EINVAL, bad_wr set, nothing posted");

	/* A misaligned word: an invalid request at the responder (rxe's misaligned atomic). */
	src = AW_A;
	ibv_wr_start(x);
	x->wr_id = 400;
	ibv_wr_atomic_write(x, rkey, raddr + AW + 196, &src);
	if (ibv_wr_complete(x))
		fail("wr_complete of a misaligned ATOMIC_WRITE");
	expect_status(s, 400, IBV_WC_REM_INV_REQ_ERR);
	say(s, 1); /* the server checks, resets, says so */
	hear(s);
	reconnect_rc(s);
	say(s, 1);
	ok("a misaligned wr_atomic_write: IBV_WC_REM_INV_REQ_ERR");

	/* Through an MR without remote write (remote atomics it has): a remote access error. */
	hear(s);
	ibv_wr_start(x);
	x->wr_id = 500;
	ibv_wr_atomic_write(x, rkey_no_write, raddr + AW + 200, &src);
	if (ibv_wr_complete(x))
		fail("wr_complete of an ATOMIC_WRITE through an MR without remote write");
	expect_status(s, 500, IBV_WC_REM_ACCESS_ERR);
	say(s, 1);
	hear(s);
	reconnect_rc(s);
	say(s, 1);
	ok("wr_atomic_write through an MR with remote atomic but no remote write: IBV_WC_REM_ACCESS_ERR");

	/* Up again: the next one lands. */
	hear(s);
	src = AW_B;
	ibv_wr_start(x);
	x->wr_id = 600;
	ibv_wr_atomic_write(x, rkey, raddr + AW + 208, &src);
	if (ibv_wr_complete(x))
		fail("wr_complete after the reset");
	expect1(s, 600, IBV_WC_ATOMIC_WRITE, -1);
	say(s, 1);
	hear(s);
	ok("after a reset the QPs carry ATOMIC_WRITEs again");
}

/* The 8 bytes at `off` of our buffer, read as one 64-bit atomic load. */
static uint64_t word_at(struct side *s, uint32_t off)
{
	return __atomic_load_n((uint64_t *)(s->buf + off), __ATOMIC_ACQUIRE);
}

static void server_aw(struct side *s)
{
	say(s, s->mr_no_write->rkey);
	hear(s);
	static const uint64_t v[3] = { 0x1111222233334444ull, 0x5555666677778888ull, 0x99990000aaaabbbbull };
	for (int i = 0; i < 3; i++) {
		uint32_t off = AW + (i == 2 ? 24 : 8 * i);
		if (word_at(s, off) != v[i])
			fail("ATOMIC_WRITE %d: the word is %#lx, expected %#lx", i, (unsigned long)word_at(s, off),
			     (unsigned long)v[i]);
	}
	check_untouched(s, AW + 16, 8, "the word no ATOMIC_WRITE named");
	check_untouched(s, AW + 32, 32, "the bytes after the ATOMIC_WRITEs");
	check_untouched(s, AW - 8, 8, "the bytes before the ATOMIC_WRITEs");
	check_bytes(s, AW + 64, 64, 1, 0, "the WRITE before them");
	say(s, 1);
	ok("ATOMIC_WRITEs landed: exactly their 8 bytes each, nothing around them; the WRITE before them too");

	/* Read the word with atomic loads while the client writes it a thousand times: every
	 * value is one it wrote (or the sentinel before the first). */
	uint64_t sentinel;
	memset(&sentinel, SENTINEL, 8);
	say(s, 1);
	long reads = 0, changes = 0;
	uint64_t last = sentinel;
	for (;;) {
		for (int i = 0; i < 4096; i++) {
			uint64_t w = word_at(s, AW + 128);
			if (w != AW_A && w != AW_B && w != sentinel)
				fail("a torn word %#lx after %ld reads", (unsigned long)w, reads);
			changes += w != last;
			last = w;
			reads++;
		}
		struct pollfd p = { .fd = s->sock, .events = POLLIN };
		if (poll(&p, 1, 0) == 1)
			break;
	}
	hear(s);
	/* The last ATOMIC_WRITE (number 999, odd) wrote AW_B. */
	if (word_at(s, AW + 128) != AW_B)
		fail("after %d ATOMIC_WRITEs the word is %#lx", AW_HAMMER, (unsigned long)word_at(s, AW + 128));
	say(s, 1);
	ok("atomic loads while %d ATOMIC_WRITEs landed: never a torn word (%ld loads, %ld changes seen), the last "
	   "value last", AW_HAMMER, reads, changes);

	hear(s); /* the misaligned one failed */
	check_untouched(s, AW + 192, 16, "the words a misaligned ATOMIC_WRITE named");
	reconnect_rc(s);
	say(s, 1);
	hear(s);
	say(s, 1);
	hear(s); /* the one through the MR without remote write failed */
	check_untouched(s, AW + 200, 8, "the word an ATOMIC_WRITE without remote write named");
	reconnect_rc(s);
	say(s, 1);
	hear(s);
	ok("misaligned and unwritable ATOMIC_WRITEs stored nothing; QPs reset");
	say(s, 1);
	hear(s);
	if (word_at(s, AW + 208) != AW_B)
		fail("the ATOMIC_WRITE after the reset: the word is %#lx", (unsigned long)word_at(s, AW + 208));
	say(s, 1);
	ok("the ATOMIC_WRITE after the reset landed");
}

int main(int argc, char **argv)
{
	struct side s = { 0 };
	s.server = argc == 4 && !strcmp(argv[1], "server");
	if (!s.server && !(argc == 5 && !strcmp(argv[1], "client"))) {
		fprintf(stderr, "usage: ex_check server PORT MODE | client HOST PORT MODE\n");
		return 2;
	}
	const char *mode = argv[argc - 1];
	if (strcmp(mode, "rc") && strcmp(mode, "ud") && strcmp(mode, "aw"))
		fail("unknown mode %s", mode);
	s.ud = !strcmp(mode, "ud");
	s.aw = !strcmp(mode, "aw");
	s.sock = s.server ? listen_on(argv[2]) : connect_to(argv[2], argv[3]);
	setup(&s);
	if (s.ud)
		s.server ? server_ud(&s) : client_ud(&s);
	else if (s.aw)
		s.server ? server_aw(&s) : client_aw(&s);
	else
		s.server ? server_rc(&s) : client_rc(&s);
	ok("%s %s done", s.server ? "server" : "client", mode);
	return 0;
}
