/*
 * atomic_check: atomics from several requesters, each a process on a vRNIC of its own, on one
 * 8-byte word of a responder (built against libibverbs-dev, run unmodified under `vrnic run`).
 * With engine threads the requesters' vRNICs are on different threads, each executing its
 * FETCH_AND_ADDs inside the responder's engine: an atomic must be atomic against every
 * requester on the same address, whichever thread runs it.
 *
 *   atomic_check server PORT CLIENTS N
 *   atomic_check client HOST PORT N
 *
 * The server registers the word (0) with REMOTE_ATOMIC, takes CLIENTS connections (one RC QP
 * each), says go to all at once, and waits for each client's N originals. Each client runs N
 * FETCH_AND_ADD of 1 (16 in flight) and a final CMP_AND_SWP that must fail its compare (0),
 * then sends the originals. The server checks the word is CLIENTS * N and that the originals
 * of all clients are exactly 0 .. CLIENTS * N - 1, each once (a lost or doubled update, or
 * two requesters reading one value, shows as a gap or a repeat).
 * Prints "OK <check>" per passed check; exits 1 with "FAIL ..." on the first failure. Every
 * wait is bounded.
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

#define POLL_SECONDS 30
#define IN_FLIGHT 16
#define MAX_CLIENTS 8

struct info {
	uint32_t lid, qpn, rkey;
	uint64_t addr;
};

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static uint16_t my_lid;

static void open_dev(void)
{
	int n;
	struct ibv_device **list = ibv_get_device_list(&n);
	if (!list || n < 1)
		fail("no RDMA device");
	ctx = ibv_open_device(list[0]);
	ibv_free_device_list(list);
	if (!ctx)
		fail("open device");
	pd = ibv_alloc_pd(ctx);
	if (!pd)
		fail("alloc_pd");
	struct ibv_port_attr pa;
	if (ibv_query_port(ctx, 1, &pa))
		fail("query port");
	my_lid = pa.lid;
}

static struct ibv_qp *qp_new(struct ibv_cq *cq)
{
	struct ibv_qp_init_attr ia = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
				       .cap = { .max_send_wr = IN_FLIGHT + 1, .max_recv_wr = 1,
						.max_send_sge = 1, .max_recv_sge = 1 } };
	struct ibv_qp *qp = ibv_create_qp(pd, &ia);
	if (!qp)
		fail("create_qp");
	return qp;
}

/* RESET -> INIT -> RTR -> RTS towards the peer's QP. */
static void bring_up(struct ibv_qp *qp, const struct info *peer)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1,
				 .qp_access_flags = IBV_ACCESS_REMOTE_ATOMIC | IBV_ACCESS_LOCAL_WRITE };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
		fail("modify INIT");
	a = (struct ibv_qp_attr){ .qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_4096,
				  .dest_qp_num = peer->qpn, .rq_psn = 0, .max_dest_rd_atomic = IN_FLIGHT,
				  .min_rnr_timer = 12, .ah_attr = { .dlid = peer->lid, .port_num = 1 } };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
				     IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
		fail("modify RTR");
	a = (struct ibv_qp_attr){ .qp_state = IBV_QPS_RTS, .timeout = 14, .retry_cnt = 7,
				  .rnr_retry = 7, .sq_psn = 0, .max_rd_atomic = IN_FLIGHT };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
				     IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
		fail("modify RTS");
}

static struct ibv_wc poll1(struct ibv_cq *cq)
{
	struct ibv_wc wc;
	double end = now() + POLL_SECONDS;
	for (;;) {
		int n = ibv_poll_cq(cq, 1, &wc);
		if (n < 0)
			fail("poll_cq");
		if (n == 1)
			return wc;
		if (now() > end)
			fail("no completion in %d s", POLL_SECONDS);
	}
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

static int server(const char *port, int clients, uint32_t n)
{
	if (clients < 1 || clients > MAX_CLIENTS)
		fail("1 to %d clients", MAX_CLIENTS);
	open_dev();
	uint64_t *word = aligned_alloc(4096, 4096);
	memset(word, 0, 4096);
	struct ibv_mr *mr = ibv_reg_mr(pd, word, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_ATOMIC);
	if (!mr)
		fail("reg_mr");
	struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
	if (!cq)
		fail("create_cq");
	int lfd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
	struct sockaddr_in sa = { .sin_family = AF_INET, .sin_port = htons(atoi(port)) };
	setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
	if (bind(lfd, (struct sockaddr *)&sa, sizeof sa) || listen(lfd, clients))
		fail("listen on %s", port);
	int socks[MAX_CLIENTS];
	struct ibv_qp *qps[MAX_CLIENTS];
	for (int i = 0; i < clients; i++) {
		socks[i] = accept(lfd, NULL, NULL);
		if (socks[i] < 0)
			fail("accept");
		qps[i] = qp_new(cq);
		struct info me = { my_lid, qps[i]->qp_num, mr->rkey, (uintptr_t)word }, peer;
		xfer(socks[i], &me, sizeof me, 1);
		xfer(socks[i], &peer, sizeof peer, 0);
		bring_up(qps[i], &peer);
	}
	close(lfd);
	/* Every client's QP is up (each said so by connecting its own): go, all at once. */
	for (int i = 0; i < clients; i++) {
		uint8_t ready;
		xfer(socks[i], &ready, 1, 0);
	}
	for (int i = 0; i < clients; i++)
		xfer(socks[i], "g", 1, 1);
	uint64_t total = (uint64_t)clients * n;
	uint64_t *all = malloc(total * 8);
	for (int i = 0; i < clients; i++)
		xfer(socks[i], all + (uint64_t)i * n, (size_t)n * 8, 0);
	if (*(volatile uint64_t *)word != total)
		fail("the word is %llu after %llu FETCH_AND_ADDs of 1", (unsigned long long)*word,
		     (unsigned long long)total);
	ok("the word counts every FETCH_AND_ADD of %d requesters (%llu)", clients,
	   (unsigned long long)total);
	qsort(all, total, 8, cmp_u64);
	for (uint64_t k = 0; k < total; k++)
		if (all[k] != k)
			fail("originals are not 0..%llu each once: position %llu holds %llu",
			     (unsigned long long)total - 1, (unsigned long long)k,
			     (unsigned long long)all[k]);
	ok("every original distinct: 0..%llu each once", (unsigned long long)total - 1);
	for (int i = 0; i < clients; i++)
		xfer(socks[i], "d", 1, 1);
	printf("OK done\n");
	return 0;
}

static int client(const char *host, const char *port, uint32_t n)
{
	open_dev();
	uint64_t *res = aligned_alloc(4096, 4096);
	memset(res, 0xff, 4096);
	struct ibv_mr *mr = ibv_reg_mr(pd, res, 4096, IBV_ACCESS_LOCAL_WRITE);
	if (!mr)
		fail("reg_mr");
	struct ibv_cq *cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	if (!cq)
		fail("create_cq");
	struct ibv_qp *qp = qp_new(cq);
	int sock = connect_to(host, port);
	struct info me = { my_lid, qp->qp_num, 0, 0 }, peer;
	xfer(sock, &peer, sizeof peer, 0);
	xfer(sock, &me, sizeof me, 1);
	bring_up(qp, &peer);
	xfer(sock, "r", 1, 1);
	uint8_t go;
	xfer(sock, &go, 1, 0);
	uint64_t *got = malloc((size_t)n * 8);
	uint32_t posted = 0, done = 0, out = 0;
	while (done < n) {
		while (posted < n && out < IN_FLIGHT) {
			struct ibv_sge sge = { (uintptr_t)&res[posted % IN_FLIGHT], 8, mr->lkey };
			struct ibv_send_wr wr = { .wr_id = posted, .sg_list = &sge, .num_sge = 1,
						  .opcode = IBV_WR_ATOMIC_FETCH_AND_ADD,
						  .send_flags = IBV_SEND_SIGNALED }, *bad;
			wr.wr.atomic.remote_addr = peer.addr;
			wr.wr.atomic.rkey = peer.rkey;
			wr.wr.atomic.compare_add = 1;
			if (ibv_post_send(qp, &wr, &bad))
				fail("post FETCH_AND_ADD");
			posted++;
			out++;
		}
		struct ibv_wc wc = poll1(cq);
		if (wc.status != IBV_WC_SUCCESS || wc.opcode != IBV_WC_FETCH_ADD)
			fail("FETCH_AND_ADD %llu: %s, opcode %d", (unsigned long long)wc.wr_id,
			     ibv_wc_status_str(wc.status), wc.opcode);
		/* Completions come in order on one QP: this one's slot is free again after. */
		got[wc.wr_id] = res[wc.wr_id % IN_FLIGHT];
		done++;
		out--;
	}
	ok("%u FETCH_AND_ADDs completed", n);
	/* The word is at least n now (this client's own adds): a compare with 0 must fail and
	 * return it unchanged. */
	struct ibv_sge sge = { (uintptr_t)&res[0], 8, mr->lkey };
	struct ibv_send_wr wr = { .wr_id = n, .sg_list = &sge, .num_sge = 1,
				  .opcode = IBV_WR_ATOMIC_CMP_AND_SWP, .send_flags = IBV_SEND_SIGNALED },
			   *bad;
	wr.wr.atomic.remote_addr = peer.addr;
	wr.wr.atomic.rkey = peer.rkey;
	wr.wr.atomic.compare_add = 0;
	wr.wr.atomic.swap = 0xdead;
	if (ibv_post_send(qp, &wr, &bad))
		fail("post CMP_AND_SWP");
	struct ibv_wc wc = poll1(cq);
	if (wc.status != IBV_WC_SUCCESS || res[0] < n)
		fail("CMP_AND_SWP: %s, original %llu", ibv_wc_status_str(wc.status),
		     (unsigned long long)res[0]);
	ok("CMP_AND_SWP with a stale compare leaves the word (%llu)", (unsigned long long)res[0]);
	xfer(sock, got, (size_t)n * 8, 1);
	uint8_t d;
	xfer(sock, &d, 1, 0);
	printf("OK done\n");
	return 0;
}

int main(int argc, char **argv)
{
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (argc == 5 && !strcmp(argv[1], "server"))
		return server(argv[2], atoi(argv[3]), (uint32_t)strtoul(argv[4], NULL, 10));
	if (argc == 5 && !strcmp(argv[1], "client"))
		return client(argv[2], argv[3], (uint32_t)strtoul(argv[4], NULL, 10));
	fprintf(stderr, "usage: atomic_check server PORT CLIENTS N | client HOST PORT N\n");
	return 2;
}
