/*
 * phases_check: a server that runs one test after another on the same device, as qperf and
 * perftest-style harnesses do. The server forks a child per client connection; the client
 * connects once per phase. Phases alternate between bandwidth (SENDs streamed against refilled
 * receives, polled) and latency in completion-event mode (a SEND ping-pong with
 * ibv_req_notify_cq / ibv_get_cq_event / ibv_ack_cq_events around every completion). Each phase
 * creates and destroys its own PD, MR, completion channel, CQ and QP, and checks every destroy
 * (ibv_dealloc_pd must not answer EBUSY). Every wait is bounded: a lost completion, event or
 * synchronisation message fails the phase instead of hanging it.
 *
 *   phases_check server PORT PHASES MODE
 *   phases_check client HOST PORT PHASES MODE
 *
 * MODE "own": each server child opens the device itself. MODE "inherit": the server opens the
 * device and allocates a PD before it listens, and each child uses that context and PD, as a
 * child may use a device context inherited through fork; after the last phase the server
 * deallocates its PD, which must not be busy (nothing a child made may stay behind).
 *
 * Prints "OK phase N ..." per phase and "OK phases done"; exits 1 with "FAIL ..." otherwise.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"

#define PHASE_SECONDS 20
#define BW_MSGS 2000
#define BW_SIZE 4096
#define BW_DEPTH 64
#define LAT_ITERS 300
#define LAT_SIZE 64
#define BUF (BW_DEPTH * BW_SIZE)

static double deadline;

static void xfer(int sock, void *buf, size_t len, int send_it)
{
	size_t done = 0;
	while (done < len) {
		struct pollfd p = { .fd = sock, .events = send_it ? POLLOUT : POLLIN };
		int left = (int)((deadline - now()) * 1000);
		if (left <= 0 || poll(&p, 1, left) != 1)
			fail("socket %s: no peer within the phase's %d s", send_it ? "send" : "recv",
			     PHASE_SECONDS);
		ssize_t n = send_it ? send(sock, (char *)buf + done, len - done, MSG_NOSIGNAL)
				    : recv(sock, (char *)buf + done, len - done, 0);
		if (n <= 0)
			fail("socket %s", send_it ? "send" : "recv");
		done += n;
	}
}

struct info {
	uint32_t lid, qpn;
};

struct phase {
	struct ibv_context *ctx;
	struct ibv_pd *shared_pd;
	struct ibv_pd *pd;
	struct ibv_mr *mr;
	struct ibv_comp_channel *ch;
	struct ibv_cq *cq;
	struct ibv_qp *qp;
	uint8_t *buf;
	int sock, events;
	unsigned armed;
};

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

static void setup(struct phase *p)
{
	p->pd = p->shared_pd ? p->shared_pd : ibv_alloc_pd(p->ctx);
	if (!p->pd)
		fail("alloc_pd");
	p->buf = calloc(1, BUF);
	p->mr = ibv_reg_mr(p->pd, p->buf, BUF, IBV_ACCESS_LOCAL_WRITE);
	if (!p->mr)
		fail("reg_mr");
	p->ch = p->events ? ibv_create_comp_channel(p->ctx) : NULL;
	if (p->events && !p->ch)
		fail("create_comp_channel");
	p->cq = ibv_create_cq(p->ctx, 2 * BW_DEPTH + 8, NULL, p->ch, 0);
	if (!p->cq)
		fail("create_cq");
	struct ibv_qp_init_attr ia = { .send_cq = p->cq, .recv_cq = p->cq, .qp_type = IBV_QPT_RC,
				       .cap = { .max_send_wr = BW_DEPTH, .max_recv_wr = BW_DEPTH,
						.max_send_sge = 1, .max_recv_sge = 1 } };
	p->qp = ibv_create_qp(p->pd, &ia);
	if (!p->qp)
		fail("create_qp");
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1,
				 .qp_access_flags = IBV_ACCESS_LOCAL_WRITE };
	if (ibv_modify_qp(p->qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
		fail("modify INIT");
	struct ibv_port_attr pa;
	if (ibv_query_port(p->ctx, 1, &pa))
		fail("query_port");
	struct info me = { .lid = pa.lid, .qpn = p->qp->qp_num }, peer;
	xfer(p->sock, &me, sizeof me, 1);
	xfer(p->sock, &peer, sizeof peer, 0);
	a = (struct ibv_qp_attr){ .qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_4096, .dest_qp_num = peer.qpn,
				  .max_dest_rd_atomic = 1, .min_rnr_timer = 12,
				  .ah_attr = { .dlid = peer.lid, .port_num = 1 } };
	if (ibv_modify_qp(p->qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
					     IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
		fail("modify RTR");
	a = (struct ibv_qp_attr){ .qp_state = IBV_QPS_RTS, .timeout = 14, .retry_cnt = 7, .rnr_retry = 7,
				  .max_rd_atomic = 1 };
	if (ibv_modify_qp(p->qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
					     IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
		fail("modify RTS");
	if (p->events && ibv_req_notify_cq(p->cq, 0))
		fail("req_notify_cq");
}

/* Destroys everything of the phase, checking each call, in the order applications use. */
static void teardown(struct phase *p)
{
	int rc;
	if ((rc = ibv_destroy_qp(p->qp)))
		fail("destroy_qp: %d", rc);
	if (p->events && p->armed)
		ibv_ack_cq_events(p->cq, 0);
	if ((rc = ibv_destroy_cq(p->cq)))
		fail("destroy_cq: %d", rc);
	if (p->ch && (rc = ibv_destroy_comp_channel(p->ch)))
		fail("destroy_comp_channel: %d", rc);
	if ((rc = ibv_dereg_mr(p->mr)))
		fail("dereg_mr: %d", rc);
	if (!p->shared_pd && (rc = ibv_dealloc_pd(p->pd)))
		fail("dealloc_pd: %d (%s)", rc, strerror(rc));
	free(p->buf);
}

static void post_recv(struct phase *p, uint64_t id, uint32_t len)
{
	struct ibv_sge sge = { .addr = (uintptr_t)p->buf + (id % BW_DEPTH) * BW_SIZE, .length = len,
			       .lkey = p->mr->lkey };
	struct ibv_recv_wr wr = { .wr_id = id, .sg_list = &sge, .num_sge = 1 }, *bad;
	if (ibv_post_recv(p->qp, &wr, &bad))
		fail("post_recv");
}

static void post_send(struct phase *p, uint64_t id, uint32_t len)
{
	struct ibv_sge sge = { .addr = (uintptr_t)p->buf, .length = len, .lkey = p->mr->lkey };
	struct ibv_send_wr wr = { .wr_id = id, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND,
				  .send_flags = IBV_SEND_SIGNALED }, *bad;
	if (ibv_post_send(p->qp, &wr, &bad))
		fail("post_send");
}

/* The next completion: polled in a loop (bandwidth), or in event mode: arm, poll once more for
 * what came before the arm, then wait for the channel (bounded), get the event and ack it. */
static struct ibv_wc next_wc(struct phase *p)
{
	struct ibv_wc wc;
	for (long i = 0;; i++) {
		int n = ibv_poll_cq(p->cq, 1, &wc);
		if (n < 0)
			fail("poll_cq");
		if (n == 1) {
			if (wc.status != IBV_WC_SUCCESS)
				fail("wr %lu: %s", (unsigned long)wc.wr_id, ibv_wc_status_str(wc.status));
			return wc;
		}
		if (p->events) {
			if (ibv_req_notify_cq(p->cq, 0))
				fail("req_notify_cq");
			if (ibv_poll_cq(p->cq, 0, &wc) < 0)
				fail("poll_cq");
			n = ibv_poll_cq(p->cq, 1, &wc);
			if (n == 1) {
				if (wc.status != IBV_WC_SUCCESS)
					fail("wr %lu: %s", (unsigned long)wc.wr_id, ibv_wc_status_str(wc.status));
				return wc;
			}
			struct pollfd pf = { .fd = p->ch->fd, .events = POLLIN };
			int left = (int)((deadline - now()) * 1000);
			if (left <= 0 || poll(&pf, 1, left) != 1)
				fail("no completion event within the phase's %d s", PHASE_SECONDS);
			struct ibv_cq *ev;
			void *ectx;
			if (ibv_get_cq_event(p->ch, &ev, &ectx))
				fail("get_cq_event");
			if (ev != p->cq)
				fail("event for another CQ");
			ibv_ack_cq_events(ev, 1);
		} else if ((i & 0xfff) == 0xfff && now() > deadline) {
			fail("no completion within the phase's %d s", PHASE_SECONDS);
		}
	}
}

/* Bandwidth: the client streams BW_MSGS sends, the server keeps BW_DEPTH receives posted. */
static void bw(struct phase *p, int server)
{
	if (server) {
		for (uint64_t i = 0; i < BW_DEPTH; i++)
			post_recv(p, i, BW_SIZE);
		char go = 1;
		xfer(p->sock, &go, 1, 1);
		for (uint64_t got = 0; got < BW_MSGS; got++) {
			struct ibv_wc wc = next_wc(p);
			if (wc.opcode != IBV_WC_RECV || wc.wr_id != got || wc.byte_len != BW_SIZE)
				fail("bw: receive %lu: wr %lu len %u", (unsigned long)got,
				     (unsigned long)wc.wr_id, wc.byte_len);
			if (got + BW_DEPTH < BW_MSGS)
				post_recv(p, got + BW_DEPTH, BW_SIZE);
		}
	} else {
		char go;
		xfer(p->sock, &go, 1, 0);
		uint64_t posted = 0, done = 0;
		while (done < BW_MSGS) {
			while (posted < BW_MSGS && posted - done < BW_DEPTH)
				post_send(p, posted++, BW_SIZE);
			next_wc(p);
			done++;
		}
	}
}

/* Latency in event mode: ping-pong; each side waits for its send and its receive. */
static void lat(struct phase *p, int server)
{
	post_recv(p, 0, LAT_SIZE);
	char go = 1;
	if (server)
		xfer(p->sock, &go, 1, 1);
	else
		xfer(p->sock, &go, 1, 0);
	for (uint64_t it = 0; it < LAT_ITERS; it++) {
		int sent = 0, recvd = 0;
		if (!server) {
			post_send(p, 1000000 + it, LAT_SIZE);
		}
		while (!recvd || (!server && !sent)) {
			struct ibv_wc wc = next_wc(p);
			if (wc.opcode == IBV_WC_RECV) {
				if (wc.wr_id != it)
					fail("lat: receive wr %lu in iteration %lu", (unsigned long)wc.wr_id,
					     (unsigned long)it);
				recvd = 1;
				post_recv(p, it + 1, LAT_SIZE);
				if (server)
					post_send(p, 1000000 + it, LAT_SIZE);
			} else {
				sent = 1;
			}
		}
		if (server && !sent) {
			struct ibv_wc wc = next_wc(p);
			if (wc.opcode != IBV_WC_SEND)
				fail("lat: expected the send completion");
		}
	}
}

static void run_phase(struct ibv_context *ctx, struct ibv_pd *pd, int sock, int n, int server)
{
	deadline = now() + PHASE_SECONDS;
	struct phase p = { .ctx = ctx, .shared_pd = pd, .sock = sock, .events = n % 2 };
	setup(&p);
	if (p.events)
		lat(&p, server);
	else
		bw(&p, server);
	/* The synchronisation after the test. */
	char done = 2, peer;
	xfer(sock, &done, 1, 1);
	xfer(sock, &peer, 1, 0);
	if (peer != 2)
		fail("sync");
	teardown(&p);
	ok("phase %d %s (%s)", n, p.events ? "latency, event mode" : "bandwidth", server ? "server" : "client");
}

static int listen_on(const char *port)
{
	int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(atoi(port)) };
	setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
	if (bind(fd, (struct sockaddr *)&a, sizeof a) || listen(fd, 8))
		fail("listen on %s", port);
	return fd;
}

static int connect_to(const char *host, const char *port)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(atoi(port)) };
	if (inet_pton(AF_INET, host, &a.sin_addr) != 1)
		fail("address %s", host);
	for (int i = 0; i < 200; i++) {
		int fd = socket(AF_INET, SOCK_STREAM, 0);
		if (connect(fd, (struct sockaddr *)&a, sizeof a) == 0)
			return fd;
		close(fd);
		usleep(50000);
	}
	fail("connect to %s:%s", host, port);
	return -1;
}

int main(int argc, char **argv)
{
	int server = argc == 5 && !strcmp(argv[1], "server");
	if (!server && !(argc == 6 && !strcmp(argv[1], "client"))) {
		fprintf(stderr, "usage: phases_check server PORT PHASES MODE | client HOST PORT PHASES MODE\n");
		return 2;
	}
	int phases = atoi(argv[argc - 2]);
	int inherit = !strcmp(argv[argc - 1], "inherit");
	if (!inherit && strcmp(argv[argc - 1], "own"))
		fail("mode %s", argv[argc - 1]);
	if (server) {
		struct ibv_context *pctx = inherit ? open_ctx() : NULL;
		struct ibv_pd *ppd = inherit ? ibv_alloc_pd(pctx) : NULL;
		if (inherit && !ppd)
			fail("alloc_pd");
		int lfd = listen_on(argv[2]);
		for (int n = 0; n < phases; n++) {
			int c = accept(lfd, NULL, NULL);
			if (c < 0)
				fail("accept");
			fflush(stdout);
			pid_t pid = fork();
			if (pid < 0)
				fail("fork");
			if (pid == 0) {
				/* The child opens the device, runs one phase and leaves. */
				close(lfd);
				struct ibv_context *ctx = inherit ? pctx : open_ctx();
				run_phase(ctx, ppd, c, n, 1);
				/* Closing the inherited copy leaves the parent's context alone. */
				if (ibv_close_device(ctx))
					fail("close_device");
				exit(0);
			}
			close(c);
			int st;
			double limit = now() + PHASE_SECONDS + 5;
			pid_t w;
			while ((w = waitpid(pid, &st, WNOHANG)) == 0 && now() < limit)
				usleep(1000);
			if (w != pid) {
				kill(pid, SIGKILL);
				fail("phase %d: the server's child did not finish", n);
			}
			if (!WIFEXITED(st) || WEXITSTATUS(st))
				fail("phase %d: the server's child failed (status %#x)", n, st);
		}
		if (inherit) {
			int rc = ibv_dealloc_pd(ppd);
			if (rc)
				fail("the server's PD after the last phase: dealloc_pd %d (%s)", rc, strerror(rc));
			if (ibv_close_device(pctx))
				fail("close_device");
			ok("the server's own PD deallocates after %d children used it", phases);
		}
	} else {
		struct ibv_context *ctx = open_ctx();
		for (int n = 0; n < phases; n++) {
			int s = connect_to(argv[2], argv[3]);
			run_phase(ctx, NULL, s, n, 0);
			close(s);
		}
		if (ibv_close_device(ctx))
			fail("close_device");
	}
	ok("phases done");
	return 0;
}
