/*
 * cm_check: our own librdmacm checks, built against librdmacm-dev and run unmodified under
 * `vrnic run`. Each wait is bounded (the channel fd is polled), so a missing event fails
 * instead of hanging.
 *
 *   cm_check solo (noport PORT | addrinuse | port0 | getaddrinfo PORT | migrate PORT)
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

/* The next event on `c` within ms, which must be `want`; the caller acks it. */
static struct rdma_cm_event *expect_on(struct rdma_event_channel *c, enum rdma_cm_event_type want, int ms,
				       const char *what)
{
	struct pollfd p = { .fd = c->fd, .events = POLLIN };
	if (poll(&p, 1, ms) != 1)
		fail("%s: no event within %d ms (wanted %s)", what, ms, rdma_event_str(want));
	struct rdma_cm_event *ev;
	if (rdma_get_cm_event(c, &ev))
		fail("%s: rdma_get_cm_event", what);
	if (ev->event != want)
		fail("%s: got %s status %d, wanted %s", what, rdma_event_str(ev->event), ev->status,
		     rdma_event_str(want));
	ok("%s: %s", what, rdma_event_str(want));
	return ev;
}

/* The next event on the main channel. */
static struct rdma_cm_event *expect(enum rdma_cm_event_type want, int ms, const char *what)
{
	return expect_on(ch, want, ms, what);
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

static void same_addr(const struct sockaddr *got, socklen_t len, const struct sockaddr_in *want, const char *what)
{
	if (!got || len != sizeof *want || memcmp(got, want, sizeof *want))
		fail("%s: not the hints' address (len %u)", what, (unsigned)len);
}

/* rdma_getaddrinfo with librdmacm's semantics (librdmacm/addrinfo.c): no node and no service,
 * the address in the hints (libfabric's verbs provider asks so). */
static void solo_getaddrinfo(int port)
{
	struct rdma_addrinfo *res;
	errno = 0;
	if (rdma_getaddrinfo(NULL, NULL, NULL, &res) != -1 || errno != EINVAL)
		fail("rdma_getaddrinfo(NULL, NULL, NULL): not -1/EINVAL");
	ok("rdma_getaddrinfo with no node, service or hints: EINVAL");
	struct sockaddr_in dst = addr4(port), src = addr4(0);
	src.sin_addr.s_addr = htonl(INADDR_ANY);
	struct rdma_addrinfo h = { .ai_port_space = RDMA_PS_TCP, .ai_qp_type = IBV_QPT_RC,
				   .ai_dst_addr = (struct sockaddr *)&dst, .ai_dst_len = sizeof dst };
	if (rdma_getaddrinfo(NULL, NULL, &h, &res))
		fail("rdma_getaddrinfo(NULL, NULL, hints with ai_dst_addr): errno %d", errno);
	same_addr(res->ai_dst_addr, res->ai_dst_len, &dst, "destination from the hints");
	if (res->ai_src_len || res->ai_flags || res->ai_qp_type != IBV_QPT_RC || res->ai_port_space != RDMA_PS_TCP)
		fail("hints-only result: src_len %u flags %d qp_type %d port space %d", (unsigned)res->ai_src_len,
		     res->ai_flags, res->ai_qp_type, res->ai_port_space);
	rdma_freeaddrinfo(res);
	ok("rdma_getaddrinfo(NULL, NULL, hints with ai_dst_addr): the hints' destination, QP type, port space");
	struct rdma_addrinfo hp = { .ai_flags = RAI_PASSIVE, .ai_port_space = RDMA_PS_TCP, .ai_qp_type = IBV_QPT_RC,
				    .ai_src_addr = (struct sockaddr *)&src, .ai_src_len = sizeof src };
	if (rdma_getaddrinfo(NULL, NULL, &hp, &res))
		fail("rdma_getaddrinfo(NULL, NULL, passive hints with ai_src_addr): errno %d", errno);
	same_addr(res->ai_src_addr, res->ai_src_len, &src, "source from the passive hints");
	if (!(res->ai_flags & RAI_PASSIVE) || res->ai_dst_len)
		fail("passive hints-only result: flags %d dst_len %u", res->ai_flags, (unsigned)res->ai_dst_len);
	/* A passive endpoint made from it listens. */
	struct rdma_cm_id *l;
	if (rdma_create_ep(&l, res, NULL, NULL) || rdma_listen(l, 4))
		fail("rdma_create_ep + listen on the passive hints-only result");
	rdma_freeaddrinfo(res);
	rdma_destroy_ep(l);
	ok("rdma_getaddrinfo(NULL, NULL, RAI_PASSIVE hints with ai_src_addr): the hints' source; an endpoint on it listens");
	char service[16];
	snprintf(service, sizeof service, "%d", port);
	struct sockaddr_in mine = addr4(0);
	struct rdma_addrinfo hs = { .ai_port_space = RDMA_PS_TCP, .ai_src_addr = (struct sockaddr *)&mine,
				    .ai_src_len = sizeof mine };
	if (rdma_getaddrinfo("127.0.0.1", service, &hs, &res))
		fail("rdma_getaddrinfo(127.0.0.1, %s, hints with ai_src_addr)", service);
	same_addr(res->ai_dst_addr, res->ai_dst_len, &dst, "destination looked up");
	same_addr(res->ai_src_addr, res->ai_src_len, &mine, "source kept from the hints");
	if (res->ai_qp_type != IBV_QPT_RC)
		fail("looked-up QP type %d", res->ai_qp_type);
	rdma_freeaddrinfo(res);
	ok("rdma_getaddrinfo(node, service, hints with ai_src_addr): the node's address, the hints' source kept");
	/* AF_IB in the hints (without RAI_FAMILY) leaves the family to the resolver (librdmacm's
	 * ucma_convert_to_ai). */
	struct rdma_addrinfo hib = { .ai_family = AF_IB, .ai_port_space = RDMA_PS_TCP };
	if (rdma_getaddrinfo("127.0.0.1", service, &hib, &res))
		fail("rdma_getaddrinfo(127.0.0.1, %s, hints of family AF_IB)", service);
	same_addr(res->ai_dst_addr, res->ai_dst_len, &dst, "destination looked up with AF_IB hints");
	rdma_freeaddrinfo(res);
	ok("rdma_getaddrinfo with AF_IB in the hints: the resolver's family");
}

static void on_alarm(int sig)
{
	(void)sig;
	static const char m[] = "FAIL a call blocked for 20 s (the id still synchronous?)\n";
	if (write(1, m, sizeof m - 1) < 0)
		_exit(2);
	_exit(1);
}

/* rdma_migrate_id as librdmacm's: an id made without a channel (synchronous) moved onto a
 * channel is asynchronous from then on, as libfabric's verbs provider relies on:
 * rdma_resolve_route returns at once and ROUTE_RESOLVED comes on the new channel; connecting
 * then works by events. Migrating a synchronous id to no channel: EINVAL; an asynchronous one
 * to no channel makes it synchronous again. */
static void solo_migrate(int port)
{
	signal(SIGALRM, on_alarm);
	alarm(20);
	struct rdma_cm_id *l;
	struct sockaddr_in a = addr4(port);
	if (rdma_create_id(ch, &l, NULL, RDMA_PS_TCP) || rdma_bind_addr(l, (struct sockaddr *)&a) ||
	    rdma_listen(l, 4))
		fail("listen");
	/* As libfabric's verbs provider: a synchronous id resolves the address, then moves onto
	 * the provider's channel and resolves the route by events. */
	struct rdma_cm_id *id;
	if (rdma_create_id(NULL, &id, NULL, RDMA_PS_TCP) || rdma_resolve_addr(id, NULL, (struct sockaddr *)&a, 2000))
		fail("synchronous rdma_resolve_addr to port %d", port);
	struct rdma_event_channel *ch2 = rdma_create_event_channel();
	if (!ch2 || rdma_migrate_id(id, ch2) || id->channel != ch2)
		fail("rdma_migrate_id onto a channel");
	if (rdma_resolve_route(id, 2000))
		fail("rdma_resolve_route after migrating");
	rdma_ack_cm_event(expect_on(ch2, RDMA_CM_EVENT_ROUTE_RESOLVED, WAIT_MS, "route resolved on the new channel"));
	ok("a synchronous id migrated onto a channel is asynchronous: rdma_resolve_route returns, its event comes there");
	qp_on(id, 1);
	struct rdma_conn_param p = { .responder_resources = 1, .initiator_depth = 1, .retry_count = 7,
				     .rnr_retry_count = 7 };
	if (rdma_connect(id, &p))
		fail("rdma_connect");
	struct rdma_cm_event *ev = expect(RDMA_CM_EVENT_CONNECT_REQUEST, WAIT_MS, "listener's request");
	struct rdma_cm_id *srv = ev->id;
	rdma_ack_cm_event(ev);
	qp_on(srv, 1);
	if (rdma_accept(srv, &p))
		fail("rdma_accept");
	rdma_ack_cm_event(expect_on(ch2, RDMA_CM_EVENT_ESTABLISHED, WAIT_MS, "migrated id established"));
	rdma_ack_cm_event(expect(RDMA_CM_EVENT_ESTABLISHED, WAIT_MS, "listener side established"));
	ok("the migrated id connects by events on its new channel");
	if (rdma_migrate_id(id, NULL) || id->channel == ch2 || !id->channel)
		fail("rdma_migrate_id of an asynchronous id to no channel");
	ok("rdma_migrate_id of an asynchronous id to no channel: 0, a channel of its own");
	struct rdma_cm_id *sync_id;
	if (rdma_create_id(NULL, &sync_id, NULL, RDMA_PS_TCP))
		fail("rdma_create_id without a channel");
	errno = 0;
	if (rdma_migrate_id(sync_id, NULL) != -1 || errno != EINVAL)
		fail("rdma_migrate_id of a synchronous id to no channel: not EINVAL");
	rdma_destroy_id(sync_id);
	ok("rdma_migrate_id of a synchronous id to no channel: EINVAL");
	alarm(0);
	rdma_disconnect(srv);
	rdma_destroy_qp(srv);
	rdma_destroy_id(srv);
	rdma_destroy_qp(id);
	rdma_destroy_id(id);
	rdma_destroy_id(l);
	rdma_destroy_event_channel(ch2);
}

static void solo(const char *mode, int port)
{
	struct rdma_cm_id *a, *b;
	if (!strcmp(mode, "getaddrinfo")) {
		solo_getaddrinfo(port);
		return;
	}
	if (!strcmp(mode, "migrate")) {
		solo_migrate(port);
		return;
	}
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
	/* A loopback address is no device's: bound there, an id has no verbs until it listens
	 * (libfabric's verbs provider then takes the device's interface address instead). */
	struct rdma_cm_id *c;
	struct sockaddr_in lo = addr4(0);
	if (rdma_create_id(ch, &c, NULL, RDMA_PS_TCP) || rdma_bind_addr(c, (struct sockaddr *)&lo))
		fail("bind to 127.0.0.1");
	if (c->verbs)
		fail("an id bound to 127.0.0.1 has a device");
	if (rdma_listen(c, 4) || !c->verbs)
		fail("listen on 127.0.0.1: no device");
	ok("an id bound to a loopback address has no device (verbs NULL) until it listens");
	rdma_destroy_id(c);
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
