/*
 * fanout_check: one app that talks to two peers at once (on other hosts, across peer links),
 * every byte checked. Built against libibverbs-dev and run unmodified under `vrnic run`.
 *
 *   fanout_check server PORT ID      a peer: takes one connection, then
 *                                    - receives a 1 MiB SEND and checks it (pattern of ID),
 *                                    - lets the client RDMA WRITE 1 MiB into its buffer and READ
 *                                      it back, and answers with a 1 MiB SEND of its own;
 *   fanout_check client HOST1 PORT1 HOST2 PORT2
 *                                    one context, one PD, one CQ, two RC QPs: everything above
 *                                    towards both peers at once (interleaved work requests).
 *
 * Prints "OK <check>" per passed check; "FAIL ..." and exit 1 on the first failure. Every wait
 * is bounded.
 */
#define _GNU_SOURCE
#include <infiniband/verbs.h>
#include <stdint.h>

#include "check.h"
#include "exchange.h"

#define LEN (1u << 20)
#define POLL_SECONDS 60

struct info {
	uint32_t lid, qpn, psn, rkey;
	uint64_t addr;
};

struct conn {
	int sock;
	struct ibv_qp *qp;
	struct info me, peer;
	uint8_t *buf; /* LEN send/recv + LEN RDMA target/source */
	struct ibv_mr *mr;
};

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static struct ibv_cq *cq;

static uint8_t pat(size_t i, uint32_t id) { return (uint8_t)(i * 13 + id * 101 + (i >> 11)); }

static void open_dev(void)
{
	int n;
	struct ibv_device **l = ibv_get_device_list(&n);
	if (!l || n < 1 || !(ctx = ibv_open_device(l[0])))
		fail("open device");
	if (!(pd = ibv_alloc_pd(ctx)) || !(cq = ibv_create_cq(ctx, 256, NULL, NULL, 0)))
		fail("pd/cq");
}

static void make_conn(struct conn *c)
{
	c->buf = aligned_alloc(4096, 2 * LEN);
	memset(c->buf, 0, 2 * LEN);
	c->mr = ibv_reg_mr(pd, c->buf, 2 * LEN,
			   IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
	struct ibv_qp_init_attr ia = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
				       .cap = { .max_send_wr = 16, .max_recv_wr = 16,
						.max_send_sge = 1, .max_recv_sge = 1 } };
	if (!c->mr || !(c->qp = ibv_create_qp(pd, &ia)))
		fail("mr/qp");
	struct ibv_port_attr pa;
	if (ibv_query_port(ctx, 1, &pa))
		fail("query port");
	c->me = (struct info){ .lid = pa.lid, .qpn = c->qp->qp_num, .psn = (c->qp->qp_num * 7919) & 0xffffff,
			       .rkey = c->mr->rkey, .addr = (uintptr_t)c->buf + LEN };
	xfer(c->sock, &c->me, sizeof c->me, 1);
	xfer(c->sock, &c->peer, sizeof c->peer, 0);
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1,
				 .qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
						    IBV_ACCESS_LOCAL_WRITE };
	if (ibv_modify_qp(c->qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
		fail("INIT");
	a = (struct ibv_qp_attr){ .qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_4096,
				  .dest_qp_num = c->peer.qpn, .rq_psn = c->peer.psn, .max_dest_rd_atomic = 4,
				  .min_rnr_timer = 12, .ah_attr = { .dlid = c->peer.lid, .port_num = 1 } };
	if (ibv_modify_qp(c->qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
				     IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
		fail("RTR");
	a = (struct ibv_qp_attr){ .qp_state = IBV_QPS_RTS, .timeout = 14, .retry_cnt = 7, .rnr_retry = 7,
				  .sq_psn = c->me.psn, .max_rd_atomic = 4 };
	if (ibv_modify_qp(c->qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
				     IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
		fail("RTS");
}

static void post(struct conn *c, uint64_t wr_id, enum ibv_wr_opcode op, void *local, uint64_t remote)
{
	struct ibv_sge sge = { .addr = (uintptr_t)local, .length = LEN, .lkey = c->mr->lkey };
	struct ibv_send_wr wr = { .wr_id = wr_id, .sg_list = &sge, .num_sge = 1, .opcode = op,
				  .send_flags = IBV_SEND_SIGNALED,
				  .wr.rdma = { .remote_addr = remote, .rkey = c->peer.rkey } }, *bad;
	if (ibv_post_send(c->qp, &wr, &bad))
		fail("post_send %lu", (unsigned long)wr_id);
}

static void post_recv(struct conn *c, uint64_t wr_id)
{
	struct ibv_sge sge = { .addr = (uintptr_t)c->buf, .length = LEN, .lkey = c->mr->lkey };
	struct ibv_recv_wr wr = { .wr_id = wr_id, .sg_list = &sge, .num_sge = 1 }, *bad;
	if (ibv_post_recv(c->qp, &wr, &bad))
		fail("post_recv");
}

/* Waits for `n` completions; each must be a success; sets done[wr_id] for each. */
static void wait_n(int n, int *done, int max_id)
{
	time_t end = time(NULL) + POLL_SECONDS;
	while (n > 0) {
		struct ibv_wc wc;
		int r = ibv_poll_cq(cq, 1, &wc);
		if (r < 0)
			fail("poll_cq");
		if (r == 0) {
			if (time(NULL) > end)
				fail("no completion in %d s (%d missing)", POLL_SECONDS, n);
			continue;
		}
		if (wc.status != IBV_WC_SUCCESS)
			fail("wr_id %lu status %s", (unsigned long)wc.wr_id, ibv_wc_status_str(wc.status));
		if ((int)wc.wr_id < max_id)
			done[wc.wr_id]++;
		n--;
	}
}

static void check(const uint8_t *b, uint32_t id, const char *what)
{
	for (size_t i = 0; i < LEN; i++)
		if (b[i] != pat(i, id))
			fail("%s: byte %zu is %u, not %u", what, i, b[i], pat(i, id));
	ok("%s", what);
}

static int server(const char *port, uint32_t id)
{
	struct conn c = { .sock = listen_on(port) };
	open_dev();
	make_conn(&c);
	post_recv(&c, 1);
	xfer(c.sock, &id, 4, 1); /* ready */
	int done[4] = { 0 };
	wait_n(1, done, 4);
	check(c.buf, 1000 + id, "server: the client's SEND");
	/* The client WRITEs into buf+LEN and READs it back; then we answer with a SEND. */
	uint32_t go;
	xfer(c.sock, &go, 4, 0);
	check(c.buf + LEN, 2000 + id, "server: the client's WRITE");
	for (size_t i = 0; i < LEN; i++)
		c.buf[i] = pat(i, 3000 + id);
	post(&c, 2, IBV_WR_SEND, c.buf, 0);
	wait_n(1, done, 4);
	xfer(c.sock, &go, 4, 0); /* the client is done */
	ok("server %u", id);
	return 0;
}

static int client(char **hp)
{
	struct conn c[2];
	uint32_t id[2];
	for (int k = 0; k < 2; k++)
		c[k] = (struct conn){ .sock = connect_to(hp[2 * k], hp[2 * k + 1]) };
	open_dev();
	for (int k = 0; k < 2; k++) {
		make_conn(&c[k]);
		xfer(c[k].sock, &id[k], 4, 0);
	}
	/* SENDs to both at once. */
	for (int k = 0; k < 2; k++) {
		for (size_t i = 0; i < LEN; i++)
			c[k].buf[i] = pat(i, 1000 + id[k]);
		post(&c[k], 10 + k, IBV_WR_SEND, c[k].buf, 0);
	}
	int done[32] = { 0 };
	wait_n(2, done, 32);
	ok("client: SENDs to both peers completed");
	/* WRITE 1 MiB to each, then READ each back into the upper half, interleaved. */
	for (int k = 0; k < 2; k++) {
		for (size_t i = 0; i < LEN; i++)
			c[k].buf[i] = pat(i, 2000 + id[k]);
		post(&c[k], 12 + k, IBV_WR_RDMA_WRITE, c[k].buf, c[k].peer.addr);
	}
	wait_n(2, done, 32);
	for (int k = 0; k < 2; k++) {
		memset(c[k].buf + LEN, 0, LEN);
		post(&c[k], 14 + k, IBV_WR_RDMA_READ, c[k].buf + LEN, c[k].peer.addr);
	}
	wait_n(2, done, 32);
	for (int k = 0; k < 2; k++) {
		check(c[k].buf + LEN, 2000 + id[k], k ? "client: READ back from peer 2" : "client: READ back from peer 1");
		post_recv(&c[k], 16 + k);
		uint32_t go = 1;
		xfer(c[k].sock, &go, 4, 1);
	}
	wait_n(2, done, 32);
	for (int k = 0; k < 2; k++) {
		check(c[k].buf, 3000 + id[k], k ? "client: SEND from peer 2" : "client: SEND from peer 1");
		uint32_t go = 1;
		xfer(c[k].sock, &go, 4, 1);
	}
	ok("client: both peers, every byte");
	return 0;
}

int main(int argc, char **argv)
{
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (argc == 4 && !strcmp(argv[1], "server"))
		return server(argv[2], (uint32_t)atoi(argv[3]));
	if (argc == 6 && !strcmp(argv[1], "client"))
		return client(argv + 2);
	fprintf(stderr, "usage: fanout_check server PORT ID | client HOST1 PORT1 HOST2 PORT2\n");
	return 2;
}
