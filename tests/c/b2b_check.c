/*
 * b2b_check: tests back to back in one long-lived process, as perftest's daemon mode or
 * rdma-core's pyverbs suite run them: ONE server process and ONE client process, joined by one
 * TCP connection, run test after test, each on fresh resources (PD, MR, CQ, QP) destroyed after
 * it, the way applications tear down (no move to ERR first, receives left posted):
 *
 *   rc_bw   RC: rounds of 128 64 KiB WRITEs in flight (every 16th signaled) with a SEND after
 *           them, then 2048 64 KiB SENDs with up to 128 in flight against receives refilled
 *           as they are checked (RNR when the sender runs ahead); 128 receives left posted
 *   ud_bw   UD: rounds of 256 datagrams, up to 128 in flight; 256 receives left posted
 *   uc_bw   UC: 1024 64 KiB WRITEs with immediate, up to 128 in flight, each send buffer refilled
 *           with the next message as soon as its completion comes (a UC send completes once
 *           sent: its buffer must have been read by then, whatever the way to the peer)
 *   rc_lat  RC ping-pong: SEND/RECV, then WRITEs polled in memory (as ib_write_lat)
 *   uc_lat  UC ping-pong: the same
 *
 * Every byte of every message is checked in every iteration, and every wait is bounded
 * (PHASE_SECONDS a test): a lost completion or message fails the test instead of hanging it.
 *
 *   b2b_check server PORT ROUNDS MODE
 *   b2b_check client HOST PORT ROUNDS MODE
 *
 * ROUNDS: how often the five tests run, in this order. MODE "once": each side opens the device
 * once and runs every test on that context; "reopen": each test opens the device and closes it
 * after its teardown.
 *
 * Prints "OK <test> round N" per test and "OK b2b done"; exits 1 with "FAIL ..." otherwise.
 */
#define _GNU_SOURCE
#include <infiniband/verbs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "check.h"
#include "exchange.h"

#define PHASE_SECONDS 30
#define BW_SLOTS 128
#define BW_SIZE 65536
#define BW_SIGNAL 16
#define W_ROUNDS 8
#define S_MSGS 2048
#define UD_ROUNDS 16
#define UD_BATCH 256
#define UD_DEPTH 128
#define UD_QKEY 0x11111111u
#define GRH 40
#define LAT_ITERS 1000
#define UC_MSGS 1024
#define UC_DEPTH 128
#define CTRL_OFF ((size_t)BW_SLOTS * BW_SIZE)

static const char *test = "setup";
static double deadline;

struct info {
	uint32_t lid, qpn, psn, rkey;
	uint64_t addr;
};

struct res {
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_mr *mr;
	struct ibv_cq *cq;
	struct ibv_qp *qp;
	struct ibv_ah *ah;
	uint8_t *buf;
	size_t len;
	struct info me, peer;
	int sock, server, own_ctx;
	/* Send side: WRs posted, and WRs known complete (through the last signaled one). */
	uint64_t posted, completed;
};

static void say(struct res *r, uint32_t v) { xfer(r->sock, &v, 4, 1); }
static uint32_t hear(struct res *r) { uint32_t v; xfer(r->sock, &v, 4, 0); return v; }

/* The pattern of message `seed`: word k is seed in the high half, k in the low. */
static void fill(uint8_t *p, size_t len, uint32_t seed)
{
	uint64_t *w = (uint64_t *)p;
	for (size_t k = 0; k < len / 8; k++)
		w[k] = (uint64_t)seed << 32 | (uint32_t)(k * 2654435761u);
}

static void check_bytes(const uint8_t *p, size_t len, uint32_t seed, const char *what, uint64_t n)
{
	const uint64_t *w = (const uint64_t *)p;
	for (size_t k = 0; k < len / 8; k++) {
		uint64_t want = (uint64_t)seed << 32 | (uint32_t)(k * 2654435761u);
		if (w[k] != want)
			fail("%s: %s %lu: word %zu of %zu is %#lx, not %#lx", test, what, (unsigned long)n, k,
			     len / 8, (unsigned long)w[k], (unsigned long)want);
	}
}

static struct ibv_context *open_ctx(void)
{
	int n;
	struct ibv_device **list = ibv_get_device_list(&n);
	if (!list || n < 1)
		fail("no RDMA device");
	struct ibv_context *ctx = ibv_open_device(list[0]);
	ibv_free_device_list(list);
	if (!ctx)
		fail("open device");
	return ctx;
}

static void setup(struct res *r, enum ibv_qp_type type, uint32_t sq, uint32_t rq, size_t len)
{
	deadline = now() + PHASE_SECONDS;
	r->posted = r->completed = 0;
	if (!r->ctx) {
		r->ctx = open_ctx();
		r->own_ctx = 1;
	}
	r->pd = ibv_alloc_pd(r->ctx);
	if (!r->pd)
		fail("%s: alloc_pd", test);
	r->len = len;
	if (posix_memalign((void **)&r->buf, 4096, len))
		fail("%s: memalign", test);
	memset(r->buf, 0, len);
	r->mr = ibv_reg_mr(r->pd, r->buf, len,
			   IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
	if (!r->mr)
		fail("%s: reg_mr", test);
	r->cq = ibv_create_cq(r->ctx, sq + rq + 8, NULL, NULL, 0);
	if (!r->cq)
		fail("%s: create_cq", test);
	struct ibv_qp_init_attr ia = { .send_cq = r->cq, .recv_cq = r->cq, .qp_type = type,
				       .cap = { .max_send_wr = sq, .max_recv_wr = rq, .max_send_sge = 1,
						.max_recv_sge = 1, .max_inline_data = 64 } };
	r->qp = ibv_create_qp(r->pd, &ia);
	if (!r->qp)
		fail("%s: create_qp", test);
	struct ibv_port_attr pa;
	if (ibv_query_port(r->ctx, 1, &pa))
		fail("%s: query_port", test);
	r->me = (struct info){ .lid = pa.lid, .qpn = r->qp->qp_num, .psn = lrand48() & 0xffffff,
			       .rkey = r->mr->rkey, .addr = (uintptr_t)r->buf };
	xfer(r->sock, &r->me, sizeof r->me, 1);
	xfer(r->sock, &r->peer, sizeof r->peer, 0);

	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1 };
	int mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT;
	if (type == IBV_QPT_UD) {
		a.qkey = UD_QKEY;
		mask |= IBV_QP_QKEY;
	} else {
		a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE;
		mask |= IBV_QP_ACCESS_FLAGS;
	}
	if (ibv_modify_qp(r->qp, &a, mask))
		fail("%s: modify INIT", test);
	a = (struct ibv_qp_attr){ .qp_state = IBV_QPS_RTR };
	mask = IBV_QP_STATE;
	if (type != IBV_QPT_UD) {
		a.path_mtu = IBV_MTU_4096;
		a.dest_qp_num = r->peer.qpn;
		a.rq_psn = r->peer.psn;
		a.ah_attr = (struct ibv_ah_attr){ .dlid = r->peer.lid, .port_num = 1 };
		mask |= IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
		if (type == IBV_QPT_RC) {
			a.max_dest_rd_atomic = 1;
			a.min_rnr_timer = 1;
			mask |= IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
		}
	}
	if (ibv_modify_qp(r->qp, &a, mask))
		fail("%s: modify RTR", test);
	a = (struct ibv_qp_attr){ .qp_state = IBV_QPS_RTS, .sq_psn = r->me.psn };
	mask = IBV_QP_STATE | IBV_QP_SQ_PSN;
	if (type == IBV_QPT_RC) {
		a.timeout = 14;
		a.retry_cnt = 7;
		a.rnr_retry = 7;
		a.max_rd_atomic = 1;
		mask |= IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
	}
	if (ibv_modify_qp(r->qp, &a, mask))
		fail("%s: modify RTS", test);
	if (type == IBV_QPT_UD) {
		struct ibv_ah_attr aa = { .dlid = r->peer.lid, .port_num = 1 };
		r->ah = ibv_create_ah(r->pd, &aa);
		if (!r->ah)
			fail("%s: create_ah", test);
	}
}

/* Everything of the test destroyed, as applications do: no move to ERR, receives left posted,
 * each call checked. */
static void teardown(struct res *r)
{
	int rc;
	/* The synchronisation after the test (perftest's ctx_close_connection). */
	say(r, 0xd0e);
	if (hear(r) != 0xd0e)
		fail("%s: sync", test);
	if (r->ah && (rc = ibv_destroy_ah(r->ah)))
		fail("%s: destroy_ah: %d", test, rc);
	r->ah = NULL;
	if ((rc = ibv_destroy_qp(r->qp)))
		fail("%s: destroy_qp: %d", test, rc);
	if ((rc = ibv_destroy_cq(r->cq)))
		fail("%s: destroy_cq: %d", test, rc);
	if ((rc = ibv_dereg_mr(r->mr)))
		fail("%s: dereg_mr: %d", test, rc);
	if ((rc = ibv_dealloc_pd(r->pd)))
		fail("%s: dealloc_pd: %d (%s)", test, rc, strerror(rc));
	free(r->buf);
	if (r->own_ctx) {
		if (ibv_close_device(r->ctx))
			fail("%s: close_device", test);
		r->ctx = NULL;
		r->own_ctx = 0;
	}
}

/* The next completion, polled, bounded by the test's deadline; a send completion advances
 * `completed` to just past its WR (wr_id is the WR's index for sends). */
static struct ibv_wc next_wc(struct res *r, const char *waiting)
{
	struct ibv_wc wc;
	for (long i = 0;; i++) {
		int n = ibv_poll_cq(r->cq, 1, &wc);
		if (n < 0)
			fail("%s: poll_cq", test);
		if (n == 1) {
			if (wc.status != IBV_WC_SUCCESS)
				fail("%s: wr %lu: %s", test, (unsigned long)wc.wr_id, ibv_wc_status_str(wc.status));
			if (!(wc.opcode & IBV_WC_RECV))
				r->completed = wc.wr_id + 1;
			return wc;
		}
		if ((i & 0xfff) == 0xfff && now() > deadline)
			fail("%s: no completion within %d s waiting for %s (sent %lu, completed %lu)", test,
			     PHASE_SECONDS, waiting, (unsigned long)r->posted, (unsigned long)r->completed);
	}
}

static void post_recv(struct res *r, uint64_t id, size_t off, uint32_t len)
{
	struct ibv_sge sge = { .addr = (uintptr_t)r->buf + off, .length = len, .lkey = r->mr->lkey };
	struct ibv_recv_wr wr = { .wr_id = id, .sg_list = &sge, .num_sge = 1 }, *bad;
	if (ibv_post_recv(r->qp, &wr, &bad))
		fail("%s: post_recv %lu", test, (unsigned long)id);
}

/* Posts send WR number r->posted (its wr_id), from `off`, signaled when `signal`. */
static void post_send(struct res *r, enum ibv_wr_opcode op, size_t off, uint32_t len, uint64_t raddr,
		      int signal, uint32_t imm)
{
	struct ibv_sge sge = { .addr = (uintptr_t)r->buf + off, .length = len, .lkey = r->mr->lkey };
	struct ibv_send_wr wr = { .wr_id = r->posted, .sg_list = &sge, .num_sge = 1, .opcode = op,
				  .send_flags = signal ? IBV_SEND_SIGNALED : 0,
				  .imm_data = htonl(imm) }, *bad;
	if (op == IBV_WR_RDMA_WRITE || op == IBV_WR_RDMA_WRITE_WITH_IMM) {
		wr.wr.rdma.remote_addr = raddr;
		wr.wr.rdma.rkey = r->peer.rkey;
	}
	if (r->ah) {
		wr.wr.ud.ah = r->ah;
		wr.wr.ud.remote_qpn = r->peer.qpn;
		wr.wr.ud.remote_qkey = UD_QKEY;
	}
	if (ibv_post_send(r->qp, &wr, &bad))
		fail("%s: post_send %lu", test, (unsigned long)r->posted);
	r->posted++;
}

/* Waits until at most `left` send WRs are outstanding. */
static void drain_to(struct res *r, uint64_t left)
{
	while (r->posted - r->completed > left) {
		struct ibv_wc wc = next_wc(r, "a send completion");
		if (wc.opcode & IBV_WC_RECV)
			fail("%s: a receive completion on the sender", test);
	}
}

static void rc_bw(struct res *r, int round)
{
	test = "rc_bw";
	/* Slots of 64 KiB, and a control area for the round's SEND. */
	setup(r, IBV_QPT_RC, 2 * BW_SLOTS, BW_SLOTS, CTRL_OFF + 4096);
	/* WRITEs: rounds of BW_SLOTS in flight, then a SEND; the server checks every slot. */
	for (uint32_t w = 0; w < W_ROUNDS; w++) {
		uint32_t seed = (uint32_t)round << 24 | w << 12;
		if (r->server) {
			post_recv(r, w, CTRL_OFF, 64);
			say(r, w);
			struct ibv_wc wc = next_wc(r, "the SEND after the WRITEs");
			if (wc.opcode != IBV_WC_RECV || wc.byte_len != 8)
				fail("%s: the SEND after round %u of WRITEs: opcode %d len %u", test, w,
				     wc.opcode, wc.byte_len);
			check_bytes(r->buf + CTRL_OFF, 8, seed | 0xfff, "the SEND after the WRITEs of round", w);
			for (uint32_t i = 0; i < BW_SLOTS; i++)
				check_bytes(r->buf + (size_t)i * BW_SIZE, BW_SIZE, seed + i, "WRITE", w * BW_SLOTS + i);
		} else {
			if (hear(r) != w)
				fail("%s: sync", test);
			for (uint32_t i = 0; i < BW_SLOTS; i++)
				fill(r->buf + (size_t)i * BW_SIZE, BW_SIZE, seed + i);
			fill(r->buf + CTRL_OFF, 8, seed | 0xfff);
			for (uint32_t i = 0; i < BW_SLOTS; i++)
				post_send(r, IBV_WR_RDMA_WRITE, (size_t)i * BW_SIZE, BW_SIZE,
					  r->peer.addr + (size_t)i * BW_SIZE, i % BW_SIGNAL == BW_SIGNAL - 1, 0);
			post_send(r, IBV_WR_SEND, CTRL_OFF, 8, 0, 1, 0);
			drain_to(r, 0);
		}
	}
	/* SENDs: streamed against receives the server refills as it checks them. */
	uint32_t seed0 = (uint32_t)round << 24 | 0x800000;
	if (r->server) {
		memset(r->buf, 0, CTRL_OFF);
		for (uint64_t i = 0; i < BW_SLOTS; i++)
			post_recv(r, i, i * BW_SIZE, BW_SIZE);
		say(r, 0x60);
		for (uint64_t got = 0; got < S_MSGS; got++) {
			struct ibv_wc wc = next_wc(r, "a SEND");
			if (wc.opcode != IBV_WC_RECV || wc.wr_id != got || wc.byte_len != BW_SIZE)
				fail("%s: receive %lu: wr %lu len %u", test, (unsigned long)got,
				     (unsigned long)wc.wr_id, wc.byte_len);
			size_t off = (got % BW_SLOTS) * BW_SIZE;
			check_bytes(r->buf + off, BW_SIZE, seed0 + (uint32_t)got, "SEND", got);
			/* Refilled past the last message too: receives stay posted at teardown. */
			post_recv(r, got + BW_SLOTS, off, BW_SIZE);
		}
	} else {
		if (hear(r) != 0x60)
			fail("%s: sync", test);
		while (r->posted - W_ROUNDS * (BW_SLOTS + 1) < S_MSGS) {
			uint64_t n = r->posted - W_ROUNDS * (BW_SLOTS + 1);
			drain_to(r, BW_SLOTS - 1);
			size_t off = (n % BW_SLOTS) * BW_SIZE;
			fill(r->buf + off, BW_SIZE, seed0 + (uint32_t)n);
			post_send(r, IBV_WR_SEND, off, BW_SIZE, 0,
				  n % BW_SIGNAL == BW_SIGNAL - 1 || n + 1 == S_MSGS, 0);
		}
		drain_to(r, 0);
	}
	teardown(r);
	ok("%s round %d: %d x %d WRITEs and %d SENDs of %d bytes, %d in flight", test, round,
	   W_ROUNDS, BW_SLOTS, S_MSGS, BW_SIZE, BW_SLOTS);
}

static void ud_bw(struct res *r, int round)
{
	test = "ud_bw";
	uint32_t size = 2048, slot = GRH + 2048;
	setup(r, IBV_QPT_UD, UD_DEPTH, 2 * UD_BATCH, (size_t)2 * UD_BATCH * slot + UD_DEPTH * size);
	struct ibv_port_attr pa;
	if (ibv_query_port(r->ctx, 1, &pa))
		fail("%s: query_port", test);
	if (pa.active_mtu < IBV_MTU_2048)
		size = 256;
	size_t sbuf = (size_t)2 * UD_BATCH * slot;
	uint64_t got = 0;
	if (r->server) {
		for (uint64_t i = 0; i < UD_BATCH; i++)
			post_recv(r, i, (i % (2 * UD_BATCH)) * slot, slot);
	}
	for (uint32_t b = 0; b < UD_ROUNDS; b++) {
		uint32_t seed = (uint32_t)round << 24 | 0x400000 | b << 12;
		if (r->server) {
			/* A batch's receives are posted before the client sends it. */
			for (uint64_t i = (b + 1) * UD_BATCH; i < (b + 2) * UD_BATCH; i++)
				post_recv(r, i, (i % (2 * UD_BATCH)) * slot, slot);
			say(r, b);
			for (uint32_t k = 0; k < UD_BATCH; k++, got++) {
				struct ibv_wc wc = next_wc(r, "a datagram");
				if (wc.opcode != IBV_WC_RECV || wc.wr_id != got || wc.byte_len != size + GRH ||
				    wc.src_qp != r->peer.qpn)
					fail("%s: receive %lu: wr %lu len %u from %u", test, (unsigned long)got,
					     (unsigned long)wc.wr_id, wc.byte_len, wc.src_qp);
				check_bytes(r->buf + (got % (2 * UD_BATCH)) * slot + GRH, size, seed + k,
					    "datagram", got);
			}
		} else {
			if (hear(r) != b)
				fail("%s: sync", test);
			for (uint32_t k = 0; k < UD_BATCH; k++) {
				drain_to(r, UD_DEPTH - 1);
				size_t off = sbuf + (r->posted % UD_DEPTH) * size;
				fill(r->buf + off, size, seed + k);
				post_send(r, IBV_WR_SEND, off, size, 0,
					  r->posted % BW_SIGNAL == BW_SIGNAL - 1 || k + 1 == UD_BATCH, 0);
			}
			drain_to(r, 0);
		}
	}
	teardown(r);
	ok("%s round %d: %d x %d datagrams of %u bytes, %d in flight", test, round, UD_ROUNDS, UD_BATCH,
	   size, UD_DEPTH);
}

static void uc_bw(struct res *r, int round)
{
	test = "uc_bw";
	size_t sbuf = CTRL_OFF;
	setup(r, IBV_QPT_UC, UC_DEPTH, BW_SLOTS, sbuf + (size_t)UC_DEPTH * BW_SIZE);
	for (uint32_t b = 0; b < UC_MSGS / BW_SLOTS; b++) {
		uint32_t seed = (uint32_t)round << 24 | 0x200000 | b << 12;
		if (r->server) {
			for (uint32_t k = 0; k < BW_SLOTS; k++)
				post_recv(r, b * BW_SLOTS + k, 0, 0);
			say(r, b);
			for (uint32_t k = 0; k < BW_SLOTS; k++) {
				struct ibv_wc wc = next_wc(r, "a WRITE with immediate");
				uint32_t imm = ntohl(wc.imm_data);
				if (wc.opcode != IBV_WC_RECV_RDMA_WITH_IMM || imm != k)
					fail("%s: batch %u message %u: opcode %d imm %u", test, b, k, wc.opcode, imm);
				check_bytes(r->buf + (size_t)k * BW_SIZE, BW_SIZE, seed + k, "WRITE",
					    b * BW_SLOTS + k);
			}
		} else {
			if (hear(r) != b)
				fail("%s: sync", test);
			for (uint32_t k = 0; k < BW_SLOTS; k++) {
				drain_to(r, UC_DEPTH - 1);
				size_t off = sbuf + (r->posted % UC_DEPTH) * BW_SIZE;
				fill(r->buf + off, BW_SIZE, seed + k);
				post_send(r, IBV_WR_RDMA_WRITE_WITH_IMM, off, BW_SIZE,
					  r->peer.addr + (size_t)k * BW_SIZE, 1, k);
			}
			drain_to(r, 0);
		}
	}
	teardown(r);
	ok("%s round %d: %d WRITEs with immediate of %d bytes from %d buffers", test, round, UC_MSGS,
	   BW_SIZE, UC_DEPTH);
}

/* Ping-pong: SENDs (each side's receive checked and reposted), then WRITEs of which the peer
 * polls the last word in memory, as ib_write_lat does. */
static void lat(struct res *r, enum ibv_qp_type type, int round)
{
	test = type == IBV_QPT_RC ? "rc_lat" : "uc_lat";
	size_t half = 1 << 16;
	setup(r, type, 16, 16, 2 * half);
	static const uint32_t sizes[] = { 8, 64, 1024, 4096, 65536 };
	uint8_t *rx = r->buf, *tx = r->buf + half;
	uint32_t base = (uint32_t)round << 24 | (type == IBV_QPT_RC ? 0x200000 : 0x300000);
	post_recv(r, 0, 0, half);
	say(r, 1);
	hear(r);
	for (uint32_t it = 0; it < LAT_ITERS; it++) {
		uint32_t len = sizes[it % 5], seed = base + it;
		if (!r->server) {
			fill(tx, len, seed);
			post_send(r, IBV_WR_SEND, half, len, 0, 1, 0);
		}
		int recvd = 0, sent = r->server;
		while (!recvd || !sent) {
			struct ibv_wc wc = next_wc(r, "a ping-pong SEND");
			if (wc.opcode == IBV_WC_RECV) {
				if (wc.wr_id != it || wc.byte_len != len)
					fail("%s: receive %u: wr %lu len %u", test, it, (unsigned long)wc.wr_id,
					     wc.byte_len);
				check_bytes(rx, len, seed, "SEND ping-pong", it);
				recvd = 1;
				post_recv(r, it + 1, 0, half);
				if (r->server) {
					fill(tx, len, seed);
					post_send(r, IBV_WR_SEND, half, len, 0, 1, 0);
					sent = 0;
				}
			} else {
				if (wc.opcode != IBV_WC_SEND || wc.wr_id + 1 != r->posted)
					fail("%s: SEND %u: completion opcode %d wr %lu, not SEND %lu", test, it,
					     wc.opcode, (unsigned long)wc.wr_id, (unsigned long)r->posted - 1);
				sent = 1;
			}
		}
	}
	/* WRITEs polled in memory: the last word of each message says it is complete. */
	say(r, 2);
	hear(r);
	for (uint32_t it = 0; it < LAT_ITERS; it++) {
		uint32_t len = sizes[it % 5], seed = base + 0x10000 + it;
		volatile uint64_t *last = (volatile uint64_t *)(rx + len - 8);
		uint64_t want = (uint64_t)seed << 32 | (uint32_t)((len / 8 - 1) * 2654435761u);
		for (int turn = 0; turn < 2; turn++) {
			if ((turn == 0) != r->server) {
				fill(tx, len, seed);
				post_send(r, IBV_WR_RDMA_WRITE, half, len, r->peer.addr, 1, 0);
				struct ibv_wc wc = next_wc(r, "a ping-pong WRITE");
				if (wc.opcode != IBV_WC_RDMA_WRITE || wc.wr_id + 1 != r->posted)
					fail("%s: WRITE %u: completion opcode %d wr %lu, not WRITE %lu", test, it,
					     wc.opcode, (unsigned long)wc.wr_id, (unsigned long)r->posted - 1);
			} else {
				for (long i = 0; *last != want; i++)
					if ((i & 0xfff) == 0xfff && now() > deadline)
						fail("%s: WRITE %u (%u bytes) not seen within %d s (last word %#lx)",
						     test, it, len, PHASE_SECONDS, (unsigned long)*last);
				__sync_synchronize();
				check_bytes(rx, len, seed, "WRITE ping-pong", it);
			}
		}
	}
	teardown(r);
	ok("%s round %d: %d SEND and %d WRITE round trips of 8..65536 bytes", test, round, LAT_ITERS,
	   LAT_ITERS);
}

int main(int argc, char **argv)
{
	int server = argc == 5 && !strcmp(argv[1], "server");
	if (!server && !(argc == 6 && !strcmp(argv[1], "client"))) {
		fprintf(stderr, "usage: b2b_check server PORT ROUNDS MODE | client HOST PORT ROUNDS MODE\n");
		return 2;
	}
	int rounds = atoi(argv[argc - 2]);
	int once = !strcmp(argv[argc - 1], "once");
	if (!once && strcmp(argv[argc - 1], "reopen"))
		fail("mode %s", argv[argc - 1]);
	srand48(getpid());
	struct res r = { .server = server };
	r.sock = server ? listen_on(argv[2]) : connect_to(argv[2], argv[3]);
	if (once)
		r.ctx = open_ctx();
	for (int n = 0; n < rounds; n++) {
		rc_bw(&r, n);
		ud_bw(&r, n);
		uc_bw(&r, n);
		lat(&r, IBV_QPT_RC, n);
		lat(&r, IBV_QPT_UC, n);
	}
	if (once && ibv_close_device(r.ctx))
		fail("close_device");
	ok("b2b done");
	return 0;
}
