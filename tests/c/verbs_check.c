/*
 * verbs_check: our own two-process verbs test, built against libibverbs-dev and run unmodified
 * under `vrnic run` (server and client on separate vRNICs of one daemon). The two sides swap
 * LID/QPN/addresses/rkeys over a TCP socket, like ibv_rc_pingpong, then check real outcomes:
 * bytes landed (or did not), completion status/opcode/byte_len/imm_data/wr_id, on the right side.
 *
 *   verbs_check server PORT MODE
 *   verbs_check client HOST PORT MODE
 *
 *   verbs_check solo devfatal [READY_FILE]
 *
 * MODE: data | badrkey | pastend | noaccess | badlkey | flush | overlap | rereg | spaced
 * Prints "OK <check>" per passed check; exits 1 with "FAIL ..." on the first failure. Every
 * wait is bounded (POLL_SECONDS for a completion), so a lost completion fails instead of hanging.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <netdb.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "exchange.h"

#define BUF_SIZE (2u << 20)
#define MR_LEN (1048576u + 64u)
#define SENTINEL 0xEE
#define POLL_SECONDS 20

struct info {
	uint32_t lid, qpn, rkey_rw, rkey_ro;
	uint64_t addr_rw, addr_ro;
};

struct side {
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_cq *cq;
	struct ibv_qp *qp;
	uint8_t *raw_rw, *raw_ro, *rw, *ro;
	struct ibv_mr *mr_rw, *mr_ro;
	struct info me, peer;
	int sock;
};

static void say(struct side *s, uint32_t v) { xfer(s->sock, &v, 4, 1); }
static uint32_t hear(struct side *s) { uint32_t v; xfer(s->sock, &v, 4, 0); return v; }

/* RESET -> INIT -> RTR -> RTS towards the peer's QP. */
static void bring_up(struct side *s)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1,
				 .qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE };
	if (ibv_modify_qp(s->qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
		fail("modify INIT");
	a = (struct ibv_qp_attr){ .qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_4096, .dest_qp_num = s->peer.qpn,
				  .rq_psn = 0, .max_dest_rd_atomic = 1, .min_rnr_timer = 12,
				  .ah_attr = { .dlid = s->peer.lid, .port_num = 1 } };
	if (ibv_modify_qp(s->qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
				     IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
		fail("modify RTR");
	a = (struct ibv_qp_attr){ .qp_state = IBV_QPS_RTS, .timeout = 14, .retry_cnt = 7, .rnr_retry = 7,
				  .sq_psn = 0, .max_rd_atomic = 1 };
	if (ibv_modify_qp(s->qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
				     IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
		fail("modify RTS");
}

/* A QP back to RESET (its CQs must forget its completions, as mlx5's do) and up again. */
static void restate(struct side *s)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_RESET };
	if (ibv_modify_qp(s->qp, &a, IBV_QP_STATE))
		fail("modify RESET");
	bring_up(s);
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
	s->pd = ibv_alloc_pd(s->ctx);
	s->cq = ibv_create_cq(s->ctx, 64, NULL, NULL, 0);
	if (!s->pd || !s->cq)
		fail("pd/cq");
	/* Unaligned buffers: malloc + 3 and + 5 bytes. */
	s->raw_rw = malloc(BUF_SIZE + 64);
	s->raw_ro = malloc(BUF_SIZE + 64);
	s->rw = s->raw_rw + 3;
	s->ro = s->raw_ro + 5;
	memset(s->rw, SENTINEL, MR_LEN);
	memset(s->ro, SENTINEL, MR_LEN);
	s->mr_rw = ibv_reg_mr(s->pd, s->rw, MR_LEN, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	s->mr_ro = ibv_reg_mr(s->pd, s->ro, MR_LEN, IBV_ACCESS_LOCAL_WRITE);
	if (!s->mr_rw || !s->mr_ro)
		fail("reg_mr");
	if (s->rw[0] != SENTINEL || s->rw[MR_LEN - 1] != SENTINEL)
		fail("registration changed the buffer's bytes");
	struct ibv_qp_init_attr ia = {
		.send_cq = s->cq, .recv_cq = s->cq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 2, .max_recv_sge = 2 },
	};
	s->qp = ibv_create_qp(s->pd, &ia);
	if (!s->qp)
		fail("create_qp");
	struct ibv_port_attr pa;
	if (ibv_query_port(s->ctx, 1, &pa))
		fail("query_port");
	s->me = (struct info){ .lid = pa.lid, .qpn = s->qp->qp_num, .rkey_rw = s->mr_rw->rkey,
			       .rkey_ro = s->mr_ro->rkey, .addr_rw = (uintptr_t)s->rw, .addr_ro = (uintptr_t)s->ro };
	xfer(s->sock, &s->me, sizeof s->me, 1);
	xfer(s->sock, &s->peer, sizeof s->peer, 0);
	bring_up(s);
	ibv_free_device_list(list);
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
			usleep(10);
		}
	}
}

static void post_recv(struct side *s, uint64_t wr_id, uint8_t *buf, uint32_t len)
{
	struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = len, .lkey = s->mr_rw->lkey };
	struct ibv_recv_wr wr = { .wr_id = wr_id, .sg_list = &sge, .num_sge = 1 }, *bad;
	if (ibv_post_recv(s->qp, &wr, &bad))
		fail("post_recv");
}

static uint8_t pat(size_t i, uint32_t size) { return (uint8_t)(i * 7 + size); }

enum { OP_SEND_IMM = 1, OP_WRITE = 2, OP_WRITE_IMM = 3, OP_SEND = 4, OP_LAST = OP_SEND };
static const char *op_name(int op)
{
	return op == OP_SEND ? "SEND" : op == OP_SEND_IMM ? "SEND_WITH_IMM" : op == OP_WRITE ? "RDMA_WRITE"
											: "RDMA_WRITE_WITH_IMM";
}
static const uint32_t sizes[] = { 0, 1, 4095, 4096, 4097, 1048576 };
#define RX_OFF 11 /* receive/write at an odd offset inside the MR */

static void server_data(struct side *s)
{
	for (;;) {
		uint32_t op = hear(s);
		if (op == 0)
			break;
		uint32_t size = hear(s);
		uint8_t *dst = s->rw + RX_OFF;
		memset(s->rw, SENTINEL, MR_LEN);
		if (op != OP_WRITE)
			post_recv(s, 1000 + op, dst, MR_LEN - RX_OFF);
		say(s, 1); /* ready */
		if (op != OP_WRITE) {
			struct ibv_wc wc = poll1(s);
			if (wc.status != IBV_WC_SUCCESS)
				fail("op %u size %u: recv status %s", op, size, ibv_wc_status_str(wc.status));
			if (wc.wr_id != 1000 + op)
				fail("recv wr_id %lu", (unsigned long)wc.wr_id);
			if ((op == OP_SEND || op == OP_SEND_IMM) && wc.opcode != IBV_WC_RECV)
				fail("%s: recv opcode %d", op_name(op), wc.opcode);
			if (op == OP_WRITE_IMM && wc.opcode != IBV_WC_RECV_RDMA_WITH_IMM)
				fail("write-imm opcode %d", wc.opcode);
			if (wc.byte_len != size)
				fail("%s: byte_len %u, expected %u", op_name(op), wc.byte_len, size);
			if (op == OP_SEND) {
				if (wc.wc_flags & IBV_WC_WITH_IMM)
					fail("SEND: IBV_WC_WITH_IMM set on a send without immediate");
			} else if (!(wc.wc_flags & IBV_WC_WITH_IMM) || ntohl(wc.imm_data) != 0xabc000u + size) {
				fail("%s: imm_data %#x flags %#x", op_name(op), ntohl(wc.imm_data), wc.wc_flags);
			}
			if (wc.qp_num != s->qp->qp_num || wc.src_qp != s->peer.qpn)
				fail("qp_num %u src_qp %u", wc.qp_num, wc.src_qp);
		} else if (hear(s) != 2) {
			fail("protocol");
		}
		for (uint32_t i = 0; i < size; i++)
			if (dst[i] != pat(i, size))
				fail("op %u size %u: byte %u is %#x, expected %#x", op, size, i, dst[i], pat(i, size));
		for (uint32_t i = 0; i < RX_OFF; i++)
			if (s->rw[i] != SENTINEL)
				fail("op %u size %u: byte before the target changed", op, size);
		if (size + RX_OFF < MR_LEN && dst[size] != SENTINEL)
			fail("op %u size %u: byte after the message changed", op, size);
		say(s, 1); /* checked */
	}
	ok("server data checks");
}

static void client_data(struct side *s)
{
	for (int op = OP_SEND_IMM; op <= OP_LAST; op++) {
		for (unsigned k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
			uint32_t size = sizes[k];
			for (uint32_t i = 0; i < size; i++)
				s->rw[i] = pat(i, size);
			say(s, op);
			say(s, size);
			hear(s);
			struct ibv_sge sge = { .addr = (uintptr_t)s->rw, .length = size, .lkey = s->mr_rw->lkey };
			struct ibv_send_wr wr = { .wr_id = 77 + k, .sg_list = &sge, .num_sge = 1,
						  .send_flags = IBV_SEND_SIGNALED,
						  .imm_data = htonl(0xabc000u + size) }, *bad;
			wr.opcode = op == OP_SEND       ? IBV_WR_SEND
				    : op == OP_SEND_IMM ? IBV_WR_SEND_WITH_IMM
				    : op == OP_WRITE    ? IBV_WR_RDMA_WRITE
							: IBV_WR_RDMA_WRITE_WITH_IMM;
			wr.wr.rdma.remote_addr = s->peer.addr_rw + RX_OFF;
			wr.wr.rdma.rkey = s->peer.rkey_rw;
			if (ibv_post_send(s->qp, &wr, &bad))
				fail("post_send");
			struct ibv_wc wc = poll1(s);
			if (wc.status != IBV_WC_SUCCESS || wc.wr_id != 77 + k)
				fail("op %d size %u: send status %s wr_id %lu", op, size, ibv_wc_status_str(wc.status),
				     (unsigned long)wc.wr_id);
			if (wc.opcode != (op == OP_SEND || op == OP_SEND_IMM ? IBV_WC_SEND : IBV_WC_RDMA_WRITE))
				fail("%s: send opcode %d", op_name(op), wc.opcode);
			if (op == OP_WRITE)
				say(s, 2);
			hear(s);
			ok("%s size %u", op_name(op), size);
		}
	}
	say(s, 0);
}

/* An error case: the first WR fails with `want`; every WR posted after it (a chain of several
 * opcodes, some aimed at valid memory) completes with IBV_WC_WR_FLUSH_ERR, in order, and moves
 * no byte. In "flush" mode, WRs posted after the error was seen are flushed too, send and
 * receive. */
static void client_error(struct side *s, const char *mode)
{
	enum { CHAIN = 6 };
	struct ibv_sge sge[CHAIN];
	struct ibv_send_wr w[CHAIN], *bad;
	memset(w, 0, sizeof w);
	memset(s->rw, 0x42, 4096);
	for (int i = 0; i < CHAIN; i++) {
		sge[i] = (struct ibv_sge){ .addr = (uintptr_t)s->rw, .length = 64, .lkey = s->mr_rw->lkey };
		w[i].wr_id = i + 1;
		w[i].sg_list = &sge[i];
		w[i].num_sge = 1;
		w[i].send_flags = IBV_SEND_SIGNALED;
		w[i].next = i + 1 < CHAIN ? &w[i + 1] : NULL;
		w[i].imm_data = htonl(0x1234);
		/* Trailing WRs: valid targets, so only the flush can stop them. */
		static const enum ibv_wr_opcode ops[] = { IBV_WR_RDMA_WRITE, IBV_WR_SEND, IBV_WR_RDMA_WRITE,
							  IBV_WR_RDMA_WRITE_WITH_IMM, IBV_WR_SEND_WITH_IMM, IBV_WR_SEND };
		w[i].opcode = ops[i];
		w[i].wr.rdma.remote_addr = s->peer.addr_rw + 100 * i;
		w[i].wr.rdma.rkey = s->peer.rkey_rw;
	}
	int chain = !strcmp(mode, "flush") ? CHAIN : 3;
	w[chain - 1].next = NULL;
	enum ibv_wc_status want = IBV_WC_REM_ACCESS_ERR;
	if (!strcmp(mode, "badrkey") || !strcmp(mode, "flush")) {
		w[0].wr.rdma.rkey = s->peer.rkey_rw ^ 0x5a5a5a5a;
	} else if (!strcmp(mode, "pastend")) {
		w[0].wr.rdma.remote_addr = s->peer.addr_rw + MR_LEN - 10;
	} else if (!strcmp(mode, "noaccess")) {
		w[0].wr.rdma.remote_addr = s->peer.addr_ro;
		w[0].wr.rdma.rkey = s->peer.rkey_ro;
	} else if (!strcmp(mode, "badlkey")) {
		sge[0].lkey ^= 0x10101;
		w[0].opcode = IBV_WR_SEND;
		want = IBV_WC_LOC_PROT_ERR;
	}
	hear(s); /* server has posted its receive */
	if (ibv_post_send(s->qp, &w[0], &bad))
		fail("post_send");
	for (uint64_t i = 1; i <= (uint64_t)chain; i++) {
		struct ibv_wc wc = poll1(s);
		enum ibv_wc_status exp = i == 1 ? want : IBV_WC_WR_FLUSH_ERR;
		if (wc.wr_id != i || wc.status != exp)
			fail("%s: wr %lu got %s (wr_id %lu), expected wr %lu with %s", mode, (unsigned long)i,
			     ibv_wc_status_str(wc.status), (unsigned long)wc.wr_id, (unsigned long)i,
			     ibv_wc_status_str(exp));
		ok("%s: wr %lu completed with %s", mode, (unsigned long)i, ibv_wc_status_str(wc.status));
	}
	struct ibv_qp_attr qa;
	struct ibv_qp_init_attr qia;
	if (ibv_query_qp(s->qp, &qa, IBV_QP_STATE, &qia) || qa.qp_state != IBV_QPS_ERR)
		fail("%s: requester QP not in ERR", mode);
	ok("%s: requester QP in ERR", mode);
	if (!strcmp(mode, "flush")) {
		/* Posting to a QP in ERR is legal; the WRs complete at once, flushed. */
		w[1].next = NULL;
		w[1].wr_id = 101;
		if (ibv_post_send(s->qp, &w[1], &bad))
			fail("flush: post_send on a QP in ERR");
		post_recv(s, 102, s->rw + 8192, 4096);
		int seen_send = 0, seen_recv = 0;
		for (int i = 0; i < 2; i++) {
			struct ibv_wc wc = poll1(s);
			if (wc.status != IBV_WC_WR_FLUSH_ERR || (wc.wr_id != 101 && wc.wr_id != 102))
				fail("flush: after ERR, wr %lu got %s", (unsigned long)wc.wr_id,
				     ibv_wc_status_str(wc.status));
			seen_send |= wc.wr_id == 101;
			seen_recv |= wc.wr_id == 102;
		}
		if (!seen_send || !seen_recv)
			fail("flush: a WR posted after the error completed twice, another not at all");
		ok("flush: send and receive posted in ERR are flushed");
		struct ibv_wc extra;
		if (ibv_poll_cq(s->cq, 1, &extra) != 0)
			fail("flush: an extra completion (wr %lu, %s)", (unsigned long)extra.wr_id,
			     ibv_wc_status_str(extra.status));
		ok("flush: no extra completions");
	}
	say(s, 1); /* done */
	hear(s);
}

static void server_error(struct side *s, const char *mode)
{
	post_recv(s, 500, s->rw + 4096, 4096);
	say(s, 1);
	hear(s); /* client saw its completions */
	for (uint32_t i = 0; i < MR_LEN; i++)
		if (s->rw[i] != SENTINEL || s->ro[i] != SENTINEL)
			fail("%s: target byte %u changed", mode, i);
	ok("%s: target memory unchanged", mode);
	if (strcmp(mode, "badlkey")) {
		/* A remote access error moves the responder to ERR too: its receive is flushed. */
		struct ibv_wc wc = poll1(s);
		if (wc.wr_id != 500 || wc.status != IBV_WC_WR_FLUSH_ERR)
			fail("%s: responder receive got %s", mode, ibv_wc_status_str(wc.status));
		ok("%s: responder receive flushed", mode);
	}
	say(s, 1);
}

static void client_overlap(struct side *s)
{
	/* A second MR over the same pages, and a third over a sub-range of it. */
	struct ibv_mr *m2 = ibv_reg_mr(s->pd, s->rw, MR_LEN, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_mr *m3 = ibv_reg_mr(s->pd, s->rw + 5000, 3000, IBV_ACCESS_LOCAL_WRITE);
	if (!m2 || !m3)
		fail("overlapping reg_mr");
	for (int i = 0; i < 8000; i++)
		s->rw[i] = pat(i, 99);
	struct ibv_mr *mrs[] = { s->mr_rw, m2, m3 };
	for (int k = 0; k < 3; k++) {
		hear(s);
		struct ibv_sge sge = { .addr = (uintptr_t)s->rw + 5000, .length = 3000, .lkey = mrs[k]->lkey };
		struct ibv_send_wr wr = { .wr_id = k, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND,
					  .send_flags = IBV_SEND_SIGNALED }, *bad;
		if (ibv_post_send(s->qp, &wr, &bad))
			fail("post_send");
		struct ibv_wc wc = poll1(s);
		if (wc.status != IBV_WC_SUCCESS)
			fail("send through MR %d: %s", k, ibv_wc_status_str(wc.status));
		hear(s);
		ok("send through overlapping MR %d", k);
	}
	say(s, 0);
	if (ibv_dereg_mr(m3) || ibv_dereg_mr(m2))
		fail("dereg overlapping");
	/* The original MR still works after its siblings are gone. */
	if (ibv_dereg_mr(s->mr_rw))
		fail("dereg");
	for (int i = 0; i < 8000; i++)
		if (s->rw[i] != pat(i, 99))
			fail("after dereg, byte %d changed", i);
	memset(s->rw, 0x11, 8000);
	if (s->rw[7999] != 0x11)
		fail("after dereg, buffer not writable");
	ok("after dereg the buffer keeps its bytes and stays writable");
	/* Closing the device with an MR still registered keeps the app's bytes too. */
	uint8_t *keep = malloc(3 * 4096 + 7) + 7;
	for (int i = 0; i < 3 * 4096; i++)
		keep[i] = pat(i, 5);
	if (!ibv_reg_mr(s->pd, keep, 3 * 4096, IBV_ACCESS_LOCAL_WRITE))
		fail("reg before close");
	if (ibv_close_device(s->ctx))
		fail("close_device");
	for (int i = 0; i < 3 * 4096; i++)
		if (keep[i] != pat(i, 5))
			fail("after close_device, byte %d changed", i);
	keep[0] = 1;
	ok("closing the device with a live MR keeps the buffer's bytes");
}

static void server_overlap(struct side *s)
{
	for (int k = 0; k < 3; k++) {
		memset(s->rw, SENTINEL, 8192);
		post_recv(s, 900 + k, s->rw + 1, 4096);
		say(s, 1);
		struct ibv_wc wc = poll1(s);
		if (wc.status != IBV_WC_SUCCESS || wc.byte_len != 3000)
			fail("overlap recv %d: %s len %u", k, ibv_wc_status_str(wc.status), wc.byte_len);
		for (int i = 0; i < 3000; i++)
			if (s->rw[1 + i] != pat(5000 + i, 99))
				fail("overlap recv %d: byte %d wrong", k, i);
		say(s, 1);
	}
	if (hear(s) != 0)
		fail("protocol");
	ok("server overlap checks");
}

/* ibv_rereg_mr as callers use it (rdma-core's own tests: test_mr.py's rereg cases):
 * 1. CHANGE_PD to another PD: a send through the MR on a QP of the old PD fails with a local
 *    protection error, the QP goes to ERR and flushes what else was posted (left unpolled, as
 *    those tests leave them); both QPs back to RESET and up again, CHANGE_PD back, and a send
 *    completes with exactly its own completion (none of the flushed ones) and lands byte for
 *    byte.
 * 2. CHANGE_TRANSLATION on both sides (new buffers, new keys): a send from the new buffer into
 *    the peer's new buffer and a write into it through its new rkey, bytes checked. */
#define REREG_SEND 300u
#define REREG_SEND2 1000u
#define REREG_WRITE 2000u
#define REREG_WOFF 8192u
#define REREG_LEN 65536u

static void expect_wc(struct side *s, uint64_t wr_id, enum ibv_wc_status st, const char *what)
{
	struct ibv_wc wc = poll1(s);
	if (wc.wr_id != wr_id || wc.status != st)
		fail("%s: got wr %lu %s, expected wr %lu %s", what, (unsigned long)wc.wr_id,
		     ibv_wc_status_str(wc.status), (unsigned long)wr_id, ibv_wc_status_str(st));
}

static void send_from(struct side *s, uint64_t wr_id, void *buf, uint32_t len, uint32_t lkey,
		      enum ibv_wr_opcode op, uint64_t raddr, uint32_t rkey)
{
	struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = len, .lkey = lkey };
	struct ibv_send_wr wr = { .wr_id = wr_id, .sg_list = &sge, .num_sge = 1, .opcode = op,
				  .send_flags = IBV_SEND_SIGNALED }, *bad;
	wr.wr.rdma.remote_addr = raddr;
	wr.wr.rdma.rkey = rkey;
	if (ibv_post_send(s->qp, &wr, &bad))
		fail("post_send wr %lu", (unsigned long)wr_id);
}

static void client_rereg(struct side *s)
{
	struct ibv_pd *pd2 = ibv_alloc_pd(s->ctx);
	if (!pd2)
		fail("alloc second PD");
	hear(s); /* the server posted a receive */
	if (ibv_rereg_mr(s->mr_rw, IBV_REREG_MR_CHANGE_PD, pd2, NULL, 0, 0))
		fail("rereg CHANGE_PD to the second PD");
	post_recv(s, 201, s->rw + 4096, 64);
	post_recv(s, 202, s->rw + 8192, 64);
	struct ibv_sge sge = { .addr = (uintptr_t)s->rw, .length = 64, .lkey = s->mr_rw->lkey };
	struct ibv_send_wr w2 = { .wr_id = 204, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND,
				  .send_flags = IBV_SEND_SIGNALED };
	struct ibv_send_wr w1 = w2, *bad;
	w1.wr_id = 203;
	w1.next = &w2;
	if (ibv_post_send(s->qp, &w1, &bad))
		fail("post_send");
	expect_wc(s, 203, IBV_WC_LOC_PROT_ERR, "send through an MR of another PD");
	ok("rereg: send through the MR moved to another PD: local protection error");
	struct ibv_qp_attr qa;
	struct ibv_qp_init_attr qia;
	if (ibv_query_qp(s->qp, &qa, IBV_QP_STATE, &qia) || qa.qp_state != IBV_QPS_ERR)
		fail("rereg: the QP is not in ERR");
	/* The flushed send and receives stay unpolled. */
	say(s, 1);
	hear(s); /* the server brought its QP up again */
	restate(s);
	if (ibv_rereg_mr(s->mr_rw, IBV_REREG_MR_CHANGE_PD, s->pd, NULL, 0, 0))
		fail("rereg CHANGE_PD back");
	for (uint32_t i = 0; i < REREG_SEND; i++)
		s->rw[i] = pat(i, REREG_SEND);
	say(s, 1); /* the server posted its receive before it answered */
	hear(s);
	send_from(s, 301, s->rw, REREG_SEND, s->mr_rw->lkey, IBV_WR_SEND, 0, 0);
	expect_wc(s, 301, IBV_WC_SUCCESS, "after RESET and CHANGE_PD back, the send");
	struct ibv_wc extra;
	if (ibv_poll_cq(s->cq, 1, &extra) != 0)
		fail("rereg: an extra completion after RESET (wr %lu, %s)", (unsigned long)extra.wr_id,
		     ibv_wc_status_str(extra.status));
	ok("rereg: after RESET the CQ holds none of the flushed completions; the send succeeds");
	hear(s); /* the server checked the bytes */

	/* 2. A new translation on both sides. */
	uint8_t *b = (uint8_t *)malloc(REREG_LEN + 64) + 9;
	for (uint32_t i = 0; i < REREG_LEN; i++)
		b[i] = pat(i, 77);
	uint32_t old_lkey = s->mr_rw->lkey;
	if (ibv_rereg_mr(s->mr_rw, IBV_REREG_MR_CHANGE_TRANSLATION, NULL, b, REREG_LEN, 0))
		fail("rereg CHANGE_TRANSLATION");
	if (s->mr_rw->addr != b || s->mr_rw->length != REREG_LEN)
		fail("rereg did not update addr/length");
	ok("rereg translation: lkey %#x -> %#x", old_lkey, s->mr_rw->lkey);
	struct info peer2;
	xfer(s->sock, &peer2, sizeof peer2, 0);
	send_from(s, 401, b, REREG_SEND2, s->mr_rw->lkey, IBV_WR_SEND, 0, 0);
	send_from(s, 402, b + 100, REREG_WRITE, s->mr_rw->lkey, IBV_WR_RDMA_WRITE,
		  peer2.addr_rw + REREG_WOFF, peer2.rkey_rw);
	expect_wc(s, 401, IBV_WC_SUCCESS, "send through the new translation");
	expect_wc(s, 402, IBV_WC_SUCCESS, "write through the new translation");
	say(s, 2);
	hear(s);
	ok("rereg: send and write through the new translations");
}

static void server_rereg(struct side *s)
{
	memset(s->rw, SENTINEL, MR_LEN);
	post_recv(s, 500, s->rw + RX_OFF, 4096);
	say(s, 1);
	hear(s); /* the client's QP failed; ours is untouched, its receive still posted */
	restate(s); /* the receive goes with the RESET, silently */
	say(s, 1);
	hear(s);
	post_recv(s, 501, s->rw + RX_OFF, 4096);
	say(s, 1);
	struct ibv_wc wc = poll1(s);
	if (wc.wr_id != 501 || wc.status != IBV_WC_SUCCESS || wc.byte_len != REREG_SEND)
		fail("rereg: receive got wr %lu %s len %u", (unsigned long)wc.wr_id,
		     ibv_wc_status_str(wc.status), wc.byte_len);
	for (uint32_t i = 0; i < REREG_SEND; i++)
		if (s->rw[RX_OFF + i] != pat(i, REREG_SEND))
			fail("rereg: byte %u of the send is %#x", i, s->rw[RX_OFF + i]);
	ok("rereg: the send after RESET landed byte for byte");
	say(s, 1);

	uint8_t *b = (uint8_t *)malloc(REREG_LEN + 64) + 5;
	memset(b, SENTINEL, REREG_LEN);
	if (ibv_rereg_mr(s->mr_rw, IBV_REREG_MR_CHANGE_TRANSLATION, NULL, b, REREG_LEN,
			 0))
		fail("rereg CHANGE_TRANSLATION");
	post_recv(s, 502, b, 4096);
	struct info me2 = s->me;
	me2.addr_rw = (uintptr_t)b;
	me2.rkey_rw = s->mr_rw->rkey;
	xfer(s->sock, &me2, sizeof me2, 1);
	wc = poll1(s);
	if (wc.wr_id != 502 || wc.status != IBV_WC_SUCCESS || wc.byte_len != REREG_SEND2)
		fail("rereg: receive in the new translation got wr %lu %s len %u", (unsigned long)wc.wr_id,
		     ibv_wc_status_str(wc.status), wc.byte_len);
	if (hear(s) != 2)
		fail("protocol");
	for (uint32_t i = 0; i < REREG_SEND2; i++)
		if (b[i] != pat(i, 77))
			fail("rereg: byte %u of the send is %#x", i, b[i]);
	for (uint32_t i = 0; i < REREG_WRITE; i++)
		if (b[REREG_WOFF + i] != pat(100 + i, 77))
			fail("rereg: byte %u of the write is %#x", i, b[REREG_WOFF + i]);
	if (b[REREG_WOFF - 1] != SENTINEL || b[REREG_WOFF + REREG_WRITE] != SENTINEL ||
	    b[REREG_SEND2] != SENTINEL)
		fail("rereg: a byte outside the messages changed");
	ok("rereg: send and write landed byte for byte in the new translation");
	say(s, 1);
}

/* "spaced": a ping-pong of SENDs whose posts come after pauses from none to 700 us, on both
 * sides, across the engine's watch timeout (200 us): a busy QP's rings are looked at every pass
 * and its driver skips the doorbell; an idle one goes back to doorbells. Every post must be seen
 * whichever side of that change it falls on: a lost one leaves its completion missing (poll1
 * fails after POLL_SECONDS). */
enum { SPACED_ROUNDS = 400, SPACED_LEN = 64 };
static uint32_t spaced_gap(uint32_t *x)
{
	*x = *x * 1103515245u + 12345u;
	uint32_t r = (*x >> 8) % 8;
	/* Half of them short (no pause, 20 us, ~ the timeout), half long (400..700 us). */
	return r < 2 ? 0 : r < 3 ? 20 : r < 4 ? 190 + (*x >> 20) % 30 : 400 + (*x >> 12) % 300;
}

static void spaced_send(struct side *s, uint64_t wr_id, uint8_t *buf)
{
	struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = SPACED_LEN, .lkey = s->mr_rw->lkey };
	struct ibv_send_wr wr = { .wr_id = wr_id, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND,
				  .send_flags = IBV_SEND_SIGNALED }, *bad;
	if (ibv_post_send(s->qp, &wr, &bad))
		fail("post_send");
}

static void spaced(struct side *s, int server)
{
	uint32_t x = server ? 7 : 11;
	uint8_t *tx = s->rw, *rx = s->rw + 4096;
	if (server)
		post_recv(s, 1 << 20, rx, SPACED_LEN);
	say(s, 1);
	hear(s);
	for (uint32_t i = 0; i < SPACED_ROUNDS; i++) {
		if (!server) {
			post_recv(s, 1 << 20 | i, rx, SPACED_LEN);
			usleep(spaced_gap(&x));
			memset(tx, (int)(i & 0xff), SPACED_LEN);
			spaced_send(s, i, tx);
		}
		/* The send's completion and the peer's message, in either order. */
		int got_send = server, got_recv = 0;
		while (!got_send || !got_recv) {
			struct ibv_wc wc = poll1(s);
			if (wc.status != IBV_WC_SUCCESS)
				fail("round %u: status %s", i, ibv_wc_status_str(wc.status));
			if (wc.opcode == IBV_WC_SEND) {
				got_send = 1;
			} else if (wc.opcode == IBV_WC_RECV && wc.byte_len == SPACED_LEN) {
				got_recv = 1;
				for (uint32_t k = 0; k < SPACED_LEN; k++)
					if (rx[k] != (uint8_t)(i & 0xff))
						fail("round %u: byte %u is %#x", i, k, rx[k]);
			} else {
				fail("round %u: opcode %d byte_len %u", i, wc.opcode, wc.byte_len);
			}
		}
		if (server) {
			if (i + 1 < SPACED_ROUNDS)
				post_recv(s, 1 << 20 | (i + 1), rx, SPACED_LEN);
			usleep(spaced_gap(&x));
			memset(tx, (int)(i & 0xff), SPACED_LEN);
			spaced_send(s, i, tx);
			struct ibv_wc wc = poll1(s);
			if (wc.status != IBV_WC_SUCCESS || wc.opcode != IBV_WC_SEND)
				fail("round %u: echo status %s opcode %d", i, ibv_wc_status_str(wc.status), wc.opcode);
		}
	}
	ok("%u rounds of sends after pauses of 0 to 700 us", SPACED_ROUNDS);
}

/* The daemon dies under an open device: the app gets IBV_EVENT_DEVICE_FATAL on its async fd
 * and later calls fail cleanly instead of hanging. */
static int solo_devfatal(const char *ready_file)
{
	int n;
	struct ibv_device **list = ibv_get_device_list(&n);
	if (!list || n < 1)
		fail("no RDMA device");
	struct ibv_context *ctx = ibv_open_device(list[0]);
	if (!ctx || !ibv_alloc_pd(ctx))
		fail("open/alloc_pd");
	printf("READY\n");
	fflush(stdout);
	/* The test waits for this file (stdout reaches it only when the program ends). */
	if (ready_file) {
		FILE *f = fopen(ready_file, "w");
		if (!f || fputs("READY\n", f) < 0 || fclose(f))
			fail("write %s", ready_file);
	}
	struct ibv_async_event ev;
	/* The port-up event of the attach may come first. */
	do {
		if (ibv_get_async_event(ctx, &ev))
			fail("get_async_event");
		if (ev.event_type == IBV_EVENT_PORT_ACTIVE)
			ibv_ack_async_event(&ev);
	} while (ev.event_type == IBV_EVENT_PORT_ACTIVE);
	if (ev.event_type != IBV_EVENT_DEVICE_FATAL)
		fail("async event %d, expected DEVICE_FATAL", ev.event_type);
	ibv_ack_async_event(&ev);
	ok("device fatal event");
	if (ibv_alloc_pd(ctx))
		fail("alloc_pd succeeded on a dead device");
	ok("calls fail after the daemon died");
	return 0;
}

int main(int argc, char **argv)
{
	struct side s = { 0 };
	if ((argc == 3 || argc == 4) && !strcmp(argv[1], "solo") && !strcmp(argv[2], "devfatal"))
		return solo_devfatal(argc == 4 ? argv[3] : NULL);
	int server = argc == 4 && !strcmp(argv[1], "server");
	if (!server && !(argc == 5 && !strcmp(argv[1], "client"))) {
		fprintf(stderr, "usage: verbs_check server PORT MODE | client HOST PORT MODE\n");
		return 2;
	}
	const char *mode = argv[argc - 1];
	s.sock = server ? listen_on(argv[2]) : connect_to(argv[2], argv[3]);
	setup(&s);
	if (!strcmp(mode, "data"))
		server ? server_data(&s) : client_data(&s);
	else if (!strcmp(mode, "rereg"))
		server ? server_rereg(&s) : client_rereg(&s);
	else if (!strcmp(mode, "overlap"))
		server ? server_overlap(&s) : client_overlap(&s);
	else if (!strcmp(mode, "spaced"))
		spaced(&s, server);
	else if (!strcmp(mode, "badrkey") || !strcmp(mode, "pastend") || !strcmp(mode, "noaccess") ||
		 !strcmp(mode, "badlkey") || !strcmp(mode, "flush"))
		server ? server_error(&s, mode) : client_error(&s, mode);
	else
		fail("unknown mode %s", mode);
	ok("%s %s done", server ? "server" : "client", mode);
	return 0;
}
