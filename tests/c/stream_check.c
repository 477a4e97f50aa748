/*
 * stream_check: bulk RDMA WRITEs and READs between two processes (across hosts, over the
 * daemons' peer link), every byte checked. Built against libibverbs-dev and run unmodified
 * under `vrnic run`.
 *
 *   stream_check server PORT [ROUNDS]       registers a 64 MiB buffer; for each round, waits
 *                                           for the client's word that it has written the
 *                                           buffer and checks every byte against the round's
 *                                           pattern;
 *   stream_check client HOST PORT [ROUNDS]  ROUNDS rounds (3 unless given; both sides must say
 *                                           the same): WRITEs the peer's buffer in 1 MiB work
 *                                           requests (16 in flight), tells the peer, then READs
 *                                           it all back (8 in flight) into a buffer of its own
 *                                           and checks it. Each round has its own pattern.
 *
 * Prints "OK <check>" per passed check; "FAIL ..." and exit 1 on the first failure. Every wait
 * is bounded.
 */
#define _GNU_SOURCE
#include <infiniband/verbs.h>
#include <stdint.h>

#include "check.h"
#include "exchange.h"

#define LEN (64u << 20)
#define CHUNK (1u << 20)
#define DEFAULT_ROUNDS 3
#define POLL_SECONDS 60

struct info {
	uint32_t lid, qpn, psn, rkey;
	uint64_t addr;
};

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static struct ibv_cq *cq;
static struct ibv_qp *qp;
static struct ibv_mr *mr;
static uint8_t *buf;
static struct info me, peer;
static uint32_t rounds = DEFAULT_ROUNDS;

static uint8_t pat(size_t i, uint32_t round) { return (uint8_t)(i * 31 + round * 77 + (i >> 12) * 5); }

static void setup(int sock)
{
	int n;
	struct ibv_device **l = ibv_get_device_list(&n);
	if (!l || n < 1 || !(ctx = ibv_open_device(l[0])))
		fail("open device");
	if (!(pd = ibv_alloc_pd(ctx)) || !(cq = ibv_create_cq(ctx, 64, NULL, NULL, 0)))
		fail("pd/cq");
	buf = aligned_alloc(4096, LEN);
	if (!buf)
		fail("alloc");
	memset(buf, 0, LEN);
	mr = ibv_reg_mr(pd, buf, LEN,
			IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
	struct ibv_qp_init_attr ia = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
				       .cap = { .max_send_wr = 32, .max_recv_wr = 4,
						.max_send_sge = 1, .max_recv_sge = 1 } };
	if (!mr || !(qp = ibv_create_qp(pd, &ia)))
		fail("mr/qp");
	struct ibv_port_attr pa;
	if (ibv_query_port(ctx, 1, &pa))
		fail("query port");
	me = (struct info){ .lid = pa.lid, .qpn = qp->qp_num, .psn = (qp->qp_num * 7919) & 0xffffff,
			    .rkey = mr->rkey, .addr = (uintptr_t)buf };
	xfer(sock, &me, sizeof me, 1);
	xfer(sock, &peer, sizeof peer, 0);
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1,
				 .qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
						    IBV_ACCESS_LOCAL_WRITE };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
		fail("INIT");
	a = (struct ibv_qp_attr){ .qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_4096,
				  .dest_qp_num = peer.qpn, .rq_psn = peer.psn, .max_dest_rd_atomic = 8,
				  .min_rnr_timer = 12, .ah_attr = { .dlid = peer.lid, .port_num = 1 } };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
				      IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
		fail("RTR");
	a = (struct ibv_qp_attr){ .qp_state = IBV_QPS_RTS, .timeout = 14, .retry_cnt = 7, .rnr_retry = 7,
				  .sq_psn = me.psn, .max_rd_atomic = 8 };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
				      IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
		fail("RTS");
}

static void check_all(const uint8_t *b, uint32_t round, const char *what)
{
	for (size_t i = 0; i < LEN; i++)
		if (b[i] != pat(i, round))
			fail("%s, round %u: byte %zu is %u, not %u", what, round, i, b[i], pat(i, round));
	ok("%s, round %u: %u MiB", what, round, LEN >> 20);
}

/* Moves the whole buffer with `op` (WRITE from buf, READ into `local`), `depth` in flight. */
static void stream(enum ibv_wr_opcode op, uint8_t *local, int depth)
{
	size_t posted = 0, done = 0, n = LEN / CHUNK;
	double end = now() + POLL_SECONDS;
	while (done < n) {
		while (posted < n && posted - done < (size_t)depth) {
			struct ibv_sge sge = { .addr = (uintptr_t)local + posted * CHUNK, .length = CHUNK,
					       .lkey = mr->lkey };
			struct ibv_send_wr wr = { .wr_id = posted, .sg_list = &sge, .num_sge = 1, .opcode = op,
						  .send_flags = IBV_SEND_SIGNALED,
						  .wr.rdma = { .remote_addr = peer.addr + posted * CHUNK,
							       .rkey = peer.rkey } },
					   *bad;
			if (ibv_post_send(qp, &wr, &bad))
				fail("post_send %zu", posted);
			posted++;
		}
		struct ibv_wc wc;
		int r = ibv_poll_cq(cq, 1, &wc);
		if (r < 0)
			fail("poll_cq");
		if (r == 0) {
			if (now() > end)
				fail("no completion in %d s (%zu of %zu done)", POLL_SECONDS, done, n);
			continue;
		}
		if (wc.status != IBV_WC_SUCCESS)
			fail("wr_id %lu status %s", (unsigned long)wc.wr_id, ibv_wc_status_str(wc.status));
		if (wc.wr_id != done)
			fail("completion %lu out of order (expected %zu)", (unsigned long)wc.wr_id, done);
		done++;
	}
}

static int server(const char *port)
{
	int sock = listen_on(port);
	setup(sock);
	for (uint32_t round = 0; round < rounds; round++) {
		uint32_t r;
		xfer(sock, &r, 4, 0); /* written */
		if (r != round)
			fail("round %u announced as %u", round, r);
		check_all(buf, round, "server: the client's WRITEs");
		xfer(sock, &r, 4, 1); /* checked: the client may READ */
		xfer(sock, &r, 4, 0); /* read back */
	}
	ok("server: every byte, %u rounds", rounds);
	return 0;
}

static int client(const char *host, const char *port)
{
	int sock = connect_to(host, port);
	setup(sock);
	/* The first half of our buffer is the WRITE source, READs land in a second one. */
	uint8_t *back = aligned_alloc(4096, LEN);
	struct ibv_mr *bmr = back ? ibv_reg_mr(pd, back, LEN, IBV_ACCESS_LOCAL_WRITE) : NULL;
	if (!bmr)
		fail("back mr");
	for (uint32_t round = 0; round < rounds; round++) {
		for (size_t i = 0; i < LEN; i++)
			buf[i] = pat(i, round);
		stream(IBV_WR_RDMA_WRITE, buf, 16);
		ok("client: WRITEs, round %u", round);
		uint32_t r = round;
		xfer(sock, &r, 4, 1);
		xfer(sock, &r, 4, 0);
		memset(back, 0, LEN);
		struct ibv_mr *keep = mr;
		mr = bmr; /* the READs' local key */
		stream(IBV_WR_RDMA_READ, back, 8);
		mr = keep;
		check_all(back, round, "client: READ back");
		xfer(sock, &r, 4, 1);
	}
	ok("client: every byte, both ways, %u rounds", rounds);
	return 0;
}

int main(int argc, char **argv)
{
	setvbuf(stdout, NULL, _IOLBF, 0);
	int is_server = argc >= 2 && !strcmp(argv[1], "server");
	int is_client = argc >= 2 && !strcmp(argv[1], "client");
	int fixed = is_server ? 3 : 4;
	if ((is_server || is_client) && argc == fixed + 1) {
		char *end;
		unsigned long r = strtoul(argv[fixed], &end, 10);
		if (*end || r < 1 || r > 1000)
			fail("ROUNDS must be 1 to 1000, not %s", argv[fixed]);
		rounds = (uint32_t)r;
	}
	if (is_server && (argc == 3 || argc == 4))
		return server(argv[2]);
	if (is_client && (argc == 4 || argc == 5))
		return client(argv[2], argv[3]);
	fprintf(stderr, "usage: stream_check server PORT [ROUNDS] | client HOST PORT [ROUNDS]\n");
	return 2;
}
