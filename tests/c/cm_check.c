/*
 * cm_check: our own librdmacm checks, built against librdmacm-dev and run unmodified under
 * `vrnic run`. Each wait is bounded (the channel fd is polled), so a missing event fails
 * instead of hanging.
 *
 *   cm_check solo (noport PORT | addrinuse | port0)
 *   cm_check server PORT (reject | disc_server | disc_client | killed)
 *   cm_check client PORT (reject | disc_server | disc_client | killed)
 *
 * Prints "OK <check>" per passed check; exits 1 with "FAIL ..." on the first failure.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <poll.h>
#include <rdma/rdma_cma.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"

#define WAIT_MS 10000

static struct rdma_event_channel *ch;

/* The next event within ms, which must be `want`; the caller acks it. */
static struct rdma_cm_event *expect(enum rdma_cm_event_type want, int ms, const char *what)
{
	struct pollfd p = { .fd = ch->fd, .events = POLLIN };
	if (poll(&p, 1, ms) != 1)
		fail("%s: no event within %d ms (wanted %s)", what, ms, rdma_event_str(want));
	struct rdma_cm_event *ev;
	if (rdma_get_cm_event(ch, &ev))
		fail("%s: rdma_get_cm_event", what);
	if (ev->event != want)
		fail("%s: got %s status %d, wanted %s", what, rdma_event_str(ev->event), ev->status,
		     rdma_event_str(want));
	ok("%s: %s", what, rdma_event_str(want));
	return ev;
}

static struct sockaddr_in addr4(int port)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(port) };
	inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
	return a;
}

static struct ibv_pd *pd;
static struct ibv_cq *cq;
static char buf[4096];
static struct ibv_mr *mr;

/* A QP on the id with `n` receives posted. */
static void qp_on(struct rdma_cm_id *id, int n)
{
	if (!pd) {
		pd = ibv_alloc_pd(id->verbs);
		cq = ibv_create_cq(id->verbs, 64, NULL, NULL, 0);
		mr = ibv_reg_mr(pd, buf, sizeof buf, IBV_ACCESS_LOCAL_WRITE);
		if (!pd || !cq || !mr)
			fail("pd/cq/mr on the id's verbs");
	}
	struct ibv_qp_init_attr ia = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
				       .cap = { .max_send_wr = 8, .max_recv_wr = 8, .max_send_sge = 1,
						.max_recv_sge = 1 } };
	if (rdma_create_qp(id, pd, &ia))
		fail("rdma_create_qp");
	for (int i = 0; i < n; i++) {
		struct ibv_sge s = { .addr = (uintptr_t)buf + i * 64, .length = 64, .lkey = mr->lkey };
		struct ibv_recv_wr w = { .wr_id = 100 + i, .sg_list = &s, .num_sge = 1 }, *bad;
		if (ibv_post_recv(id->qp, &w, &bad))
			fail("post_recv");
	}
}

/* Every posted receive completes flushed within the bound. */
static void flushed(int n, const char *what)
{
	for (int i = 0; i < n; i++) {
		struct ibv_wc wc;
		int got = 0;
		for (int t = 0; t < WAIT_MS && !got; t++) {
			got = ibv_poll_cq(cq, 1, &wc);
			if (!got)
				usleep(1000);
		}
		if (got != 1 || wc.status != IBV_WC_WR_FLUSH_ERR)
			fail("%s: receive %d not flushed (%s)", what, i, got ? ibv_wc_status_str(wc.status) : "none");
	}
	ok("%s: %d posted receives flushed", what, n);
}

static struct rdma_cm_id *connect_to(int port, const char *data, struct rdma_cm_event **out_ev)
{
	struct rdma_cm_id *id;
	struct sockaddr_in dst = addr4(port);
	if (rdma_create_id(ch, &id, NULL, RDMA_PS_TCP))
		fail("rdma_create_id");
	if (rdma_resolve_addr(id, NULL, (struct sockaddr *)&dst, 2000))
		fail("rdma_resolve_addr");
	rdma_ack_cm_event(expect(RDMA_CM_EVENT_ADDR_RESOLVED, WAIT_MS, "client resolve_addr"));
	if (rdma_resolve_route(id, 2000))
		fail("rdma_resolve_route");
	rdma_ack_cm_event(expect(RDMA_CM_EVENT_ROUTE_RESOLVED, WAIT_MS, "client resolve_route"));
	if (!out_ev)
		qp_on(id, 4);
	struct rdma_conn_param p = { .private_data = data, .private_data_len = data ? strlen(data) + 1 : 0,
				     .responder_resources = 1, .initiator_depth = 1, .retry_count = 7,
				     .rnr_retry_count = 7 };
	if (rdma_connect(id, &p))
		fail("rdma_connect");
	return id;
}

static void solo(const char *mode, int port)
{
	struct rdma_cm_id *a, *b;
	if (!strcmp(mode, "noport")) {
		struct rdma_cm_id *id = connect_to(port, NULL, NULL);
		struct rdma_cm_event *ev = expect(RDMA_CM_EVENT_REJECTED, WAIT_MS, "connect to a port nobody listens on");
		if (ev->status != 8)
			fail("reject status %d, expected 8 (invalid service ID)", ev->status);
		ok("reject status 8 (invalid service ID)");
		rdma_ack_cm_event(ev);
		rdma_destroy_qp(id);
		rdma_destroy_id(id);
		return;
	}
	if (rdma_create_id(ch, &a, NULL, RDMA_PS_TCP) || rdma_create_id(ch, &b, NULL, RDMA_PS_TCP))
		fail("create ids");
	struct sockaddr_in any = addr4(0);
	any.sin_addr.s_addr = htonl(INADDR_ANY);
	if (rdma_bind_addr(a, (struct sockaddr *)&any))
		fail("bind port 0");
	uint16_t p = ntohs(rdma_get_src_port(a));
	if (p == 0)
		fail("port 0 bound to port 0");
	ok("bind to port 0 picks port %u (rdma_get_src_port)", p);
	if (!a->verbs)
		fail("bound id without verbs");
	ok("bound id has its verbs context");
	if (rdma_listen(a, 4))
		fail("listen");
	struct sockaddr_in same = addr4(p);
	errno = 0;
	if (!rdma_bind_addr(b, (struct sockaddr *)&same) || errno != EADDRINUSE)
		fail("second bind of port %u not EADDRINUSE", p);
	ok("a second id on port %u: EADDRINUSE", p);
	rdma_destroy_id(a);
	if (rdma_bind_addr(b, (struct sockaddr *)&same))
		fail("port %u not free after destroy", p);
	ok("the port is free again once its listener is destroyed");
	rdma_destroy_id(b);
}

static void server(const char *mode, int port)
{
	struct rdma_cm_id *l;
	struct sockaddr_in a = addr4(port);
	if (rdma_create_id(ch, &l, NULL, RDMA_PS_TCP) || rdma_bind_addr(l, (struct sockaddr *)&a) ||
	    rdma_listen(l, 4))
		fail("server listen");
	printf("LISTENING\n");
	fflush(stdout);
	struct rdma_cm_event *ev = expect(RDMA_CM_EVENT_CONNECT_REQUEST, WAIT_MS * 3, "server connect request");
	struct rdma_cm_id *id = ev->id;
	if (ev->listen_id != l || !id->verbs)
		fail("request: listen_id or new id's verbs wrong");
	if (ev->param.conn.private_data_len < 6 || strcmp(ev->param.conn.private_data, "hello"))
		fail("request private data missing");
	ok("request carries the client's private data");
	rdma_ack_cm_event(ev);
	if (!strcmp(mode, "reject")) {
		if (rdma_reject(id, "busy", 5))
			fail("rdma_reject");
		ok("rejected");
		rdma_destroy_id(id);
		rdma_destroy_id(l);
		return;
	}
	qp_on(id, 4);
	if (rdma_accept(id, NULL))
		fail("rdma_accept");
	rdma_ack_cm_event(expect(RDMA_CM_EVENT_ESTABLISHED, WAIT_MS, "server established"));
	if (!strcmp(mode, "disc_server")) {
		if (rdma_disconnect(id))
			fail("rdma_disconnect");
		flushed(4, "server after its own disconnect");
		rdma_ack_cm_event(expect(RDMA_CM_EVENT_DISCONNECTED, WAIT_MS, "server disconnected"));
	} else if (!strcmp(mode, "disc_client")) {
		rdma_ack_cm_event(expect(RDMA_CM_EVENT_DISCONNECTED, WAIT_MS, "server sees the client's disconnect"));
		if (rdma_disconnect(id))
			fail("rdma_disconnect after DISCONNECTED");
		flushed(4, "server after answering the disconnect");
	} else if (!strcmp(mode, "killed")) {
		rdma_ack_cm_event(expect(RDMA_CM_EVENT_DISCONNECTED, WAIT_MS, "server sees the killed client go"));
	}
	rdma_destroy_qp(id);
	rdma_destroy_id(id);
	rdma_destroy_id(l);
}

static void client(const char *mode, int port)
{
	if (!strcmp(mode, "reject")) {
		struct rdma_cm_event *tmp;
		struct rdma_cm_id *id = connect_to(port, "hello", &tmp);
		struct rdma_cm_event *ev = expect(RDMA_CM_EVENT_REJECTED, WAIT_MS, "client rejected");
		if (ev->status != 28)
			fail("reject status %d, expected 28 (consumer defined)", ev->status);
		if (ev->param.conn.private_data_len < 5 || strcmp(ev->param.conn.private_data, "busy"))
			fail("reject private data missing");
		ok("reject status 28 with the server's private data");
		rdma_ack_cm_event(ev);
		rdma_destroy_id(id);
		return;
	}
	struct rdma_cm_id *id = connect_to(port, "hello", NULL);
	rdma_ack_cm_event(expect(RDMA_CM_EVENT_ESTABLISHED, WAIT_MS, "client established"));
	struct ibv_qp_attr qa;
	struct ibv_qp_init_attr qi;
	if (ibv_query_qp(id->qp, &qa, IBV_QP_STATE, &qi) || qa.qp_state != IBV_QPS_RTS)
		fail("client QP not in RTS after ESTABLISHED");
	ok("client QP in RTS");
	if (!strcmp(mode, "killed")) {
		kill(getpid(), SIGKILL);
	} else if (!strcmp(mode, "disc_client")) {
		if (rdma_disconnect(id))
			fail("rdma_disconnect");
		flushed(4, "client after its own disconnect");
		rdma_ack_cm_event(expect(RDMA_CM_EVENT_DISCONNECTED, WAIT_MS, "client disconnected"));
	} else {
		rdma_ack_cm_event(expect(RDMA_CM_EVENT_DISCONNECTED, WAIT_MS, "client sees the server's disconnect"));
		rdma_disconnect(id);
		flushed(4, "client after answering the disconnect");
	}
	rdma_destroy_qp(id);
	rdma_destroy_id(id);
}

int main(int argc, char **argv)
{
	setvbuf(stdout, NULL, _IOLBF, 0);
	ch = rdma_create_event_channel();
	if (!ch)
		fail("rdma_create_event_channel");
	if (argc == 3 && !strcmp(argv[1], "solo"))
		solo(argv[2], 0);
	else if (argc == 4 && !strcmp(argv[1], "solo"))
		solo(argv[2], atoi(argv[3]));
	else if (argc == 4 && !strcmp(argv[1], "server"))
		server(argv[3], atoi(argv[2]));
	else if (argc == 4 && !strcmp(argv[1], "client"))
		client(argv[3], atoi(argv[2]));
	else
		fail("usage");
	rdma_destroy_event_channel(ch);
	ok("%s done", argv[argc - 1]);
	return 0;
}
