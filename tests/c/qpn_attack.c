/*
 * qpn_attack.c: a tenant names another group's QP by its number (trust boundary). Three
 * processes, each under `vrnic run` on its own vRNIC:
 *
 *   victim PORT1 PORT2 TYPE        the target QP V (blue): connected to its legitimate peer P
 *                                  (RC, UC) or reachable by it (UD), 16 receives posted
 *   peer HOST PORT1 TYPE           P (blue, another vRNIC): one SEND "legit" when told to
 *   attacker HOST PORT2 TYPE DLID  X (red): learns V's number, PSN and Q_Key from the victim
 *                                  (as if guessed), routes its QP to DLID (a vRNIC of its own
 *                                  group that sits beside V) with V's number as destination,
 *                                  sends 4 "evil" SENDs
 *
 * The victim then has P send, and passes only if it receives exactly "legit" from P and
 * nothing else: one "evil" byte landing is a cross-tenant delivery. The attacker prints how
 * its work requests completed (`attacker status S` per WR).
 */
#include <infiniband/verbs.h>
#include <stdint.h>

#include "check.h"
#include "exchange.h"

#define RECVS 16
#define BUF 4096
#define QKEY 0x11111111u

struct info {
	uint16_t lid;
	uint32_t qpn, psn, qkey;
};

struct end {
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_cq *cq;
	struct ibv_qp *qp;
	struct ibv_mr *mr;
	char *buf;
	enum ibv_qp_type type;
	uint16_t lid;
};

static enum ibv_qp_type type_of(const char *s)
{
	if (!strcmp(s, "rc"))
		return IBV_QPT_RC;
	if (!strcmp(s, "uc"))
		return IBV_QPT_UC;
	if (!strcmp(s, "ud"))
		return IBV_QPT_UD;
	fail("type %s (rc, uc or ud)", s);
	return IBV_QPT_RC;
}

static void open_end(struct end *e, enum ibv_qp_type type)
{
	int n;
	struct ibv_device **devs = ibv_get_device_list(&n);
	if (!devs || n < 1)
		fail("no device");
	e->ctx = ibv_open_device(devs[0]);
	if (!e->ctx)
		fail("open device");
	e->type = type;
	e->pd = ibv_alloc_pd(e->ctx);
	e->cq = ibv_create_cq(e->ctx, 64, NULL, NULL, 0);
	e->buf = calloc(1, BUF * (RECVS + 1));
	e->mr = ibv_reg_mr(e->pd, e->buf, BUF * (RECVS + 1), IBV_ACCESS_LOCAL_WRITE);
	if (!e->pd || !e->cq || !e->buf || !e->mr)
		fail("resources");
	struct ibv_qp_init_attr ia = {
		.send_cq = e->cq,
		.recv_cq = e->cq,
		.qp_type = type,
		.cap = { .max_send_wr = 16, .max_recv_wr = RECVS, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	e->qp = ibv_create_qp(e->pd, &ia);
	if (!e->qp)
		fail("create qp");
	struct ibv_port_attr pa;
	if (ibv_query_port(e->ctx, 1, &pa))
		fail("query port");
	e->lid = pa.lid;
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1, .pkey_index = 0 };
	int mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT;
	if (type == IBV_QPT_UD) {
		a.qkey = QKEY;
		mask |= IBV_QP_QKEY;
	} else {
		a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE;
		mask |= IBV_QP_ACCESS_FLAGS;
	}
	if (ibv_modify_qp(e->qp, &a, mask))
		fail("INIT");
}

/* RTR then RTS: connected QPs to (dlid, dqpn), the responder expecting rq_psn, sending from
 * sq_psn; UD QPs need neither. */
static void connect_end(struct end *e, uint16_t dlid, uint32_t dqpn, uint32_t rq_psn,
			uint32_t sq_psn)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_RTR };
	int mask = IBV_QP_STATE;
	if (e->type != IBV_QPT_UD) {
		a.path_mtu = IBV_MTU_1024;
		a.dest_qp_num = dqpn;
		a.rq_psn = rq_psn;
		a.ah_attr.dlid = dlid;
		a.ah_attr.port_num = 1;
		mask |= IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
		if (e->type == IBV_QPT_RC) {
			a.max_dest_rd_atomic = 1;
			a.min_rnr_timer = 12;
			mask |= IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
		}
	}
	if (ibv_modify_qp(e->qp, &a, mask))
		fail("RTR");
	struct ibv_qp_attr s = { .qp_state = IBV_QPS_RTS, .sq_psn = sq_psn };
	mask = IBV_QP_STATE | IBV_QP_SQ_PSN;
	if (e->type == IBV_QPT_RC) {
		/* A short retry budget: an unanswered attacker fails fast. */
		s.timeout = 10;
		s.retry_cnt = 2;
		s.rnr_retry = 7;
		s.max_rd_atomic = 1;
		mask |= IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
	}
	if (ibv_modify_qp(e->qp, &s, mask))
		fail("RTS");
}

static void post_recvs(struct end *e)
{
	for (int i = 0; i < RECVS; i++) {
		struct ibv_sge sg = { (uintptr_t)e->buf + BUF * (i + 1), BUF, e->mr->lkey };
		struct ibv_recv_wr wr = { .wr_id = 100 + i, .sg_list = &sg, .num_sge = 1 }, *bad;
		if (ibv_post_recv(e->qp, &wr, &bad))
			fail("post recv");
	}
}

/* A SEND of `text` to (ah, qpn, qkey) or along the connection. */
static void send_text(struct end *e, const char *text, struct ibv_ah *ah, uint32_t qpn,
		      uint32_t qkey, uint64_t wr_id)
{
	strcpy(e->buf, text);
	struct ibv_sge sg = { (uintptr_t)e->buf, (uint32_t)strlen(text) + 1, e->mr->lkey };
	struct ibv_send_wr wr = { .wr_id = wr_id, .sg_list = &sg, .num_sge = 1,
				  .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED },
			   *bad;
	if (ah) {
		wr.wr.ud.ah = ah;
		wr.wr.ud.remote_qpn = qpn;
		wr.wr.ud.remote_qkey = qkey;
	}
	if (ibv_post_send(e->qp, &wr, &bad))
		fail("post send");
}

/* Polls up to `n` completions for at most `secs`; returns how many came. */
static int poll_for(struct end *e, struct ibv_wc *wc, int n, double secs)
{
	int got = 0;
	double end = now() + secs;
	while (got < n && now() < end) {
		int k = ibv_poll_cq(e->cq, n - got, wc + got);
		if (k < 0)
			fail("poll cq");
		got += k;
	}
	return got;
}

static struct ibv_ah *ah_to(struct end *e, uint16_t dlid)
{
	struct ibv_ah_attr aa = { .dlid = dlid, .port_num = 1 };
	struct ibv_ah *ah = ibv_create_ah(e->pd, &aa);
	if (!ah)
		fail("create ah to lid %u", dlid);
	return ah;
}

static int victim(const char *port1, const char *port2, enum ibv_qp_type type)
{
	struct end e;
	open_end(&e, type);
	post_recvs(&e);
	struct info me = { e.lid, e.qp->qp_num, 0x123456, QKEY }, peer;
	int ps = listen_on(port1);
	xfer(ps, &peer, sizeof peer, 0);
	xfer(ps, &me, sizeof me, 1);
	connect_end(&e, peer.lid, peer.qpn, me.psn, 0x654321);
	/* The attacker learns everything it would have to guess. */
	int as = listen_on(port2);
	xfer(as, &me, sizeof me, 1);
	char done;
	xfer(as, &done, 1, 0);
	ok("the attacker is done");
	char go = 'g';
	xfer(ps, &go, 1, 1);
	struct ibv_wc wc[RECVS];
	int got = poll_for(&e, wc, RECVS, 2.0);
	int legit = 0;
	for (int i = 0; i < got; i++) {
		const char *text = e.buf + BUF * (wc[i].wr_id - 100 + 1) +
				   (type == IBV_QPT_UD ? 40 : 0);
		if (wc[i].status != IBV_WC_SUCCESS)
			fail("victim completion %d: status %s", i, ibv_wc_status_str(wc[i].status));
		if (strcmp(text, "legit")) {
			errno = 0;
			fail("CROSS-TENANT DELIVERY: \"%.8s\" from qp %u lid %u", text, wc[i].src_qp,
			     wc[i].slid);
		}
		legit++;
	}
	if (legit != 1) {
		errno = 0;
		fail("%d legitimate messages, expected 1", legit);
	}
	ok("only the legitimate peer's message arrived");
	xfer(ps, &go, 1, 1);
	return 0;
}

static int peer(const char *host, const char *port1, enum ibv_qp_type type)
{
	struct end e;
	open_end(&e, type);
	struct info me = { e.lid, e.qp->qp_num, 0x654321, QKEY }, v;
	int s = connect_to(host, port1);
	xfer(s, &me, sizeof me, 1);
	xfer(s, &v, sizeof v, 0);
	connect_end(&e, v.lid, v.qpn, me.psn, v.psn);
	struct ibv_ah *ah = type == IBV_QPT_UD ? ah_to(&e, v.lid) : NULL;
	char go;
	xfer(s, &go, 1, 0);
	send_text(&e, "legit", ah, v.qpn, v.qkey, 1);
	struct ibv_wc wc;
	if (poll_for(&e, &wc, 1, 10.0) != 1 || wc.status != IBV_WC_SUCCESS)
		fail("the legitimate SEND did not complete");
	ok("legit sent");
	/* Alive until the victim has looked: a peer that exits fails its connected QP. */
	xfer(s, &go, 1, 0);
	return 0;
}

static int attacker(const char *host, const char *port2, enum ibv_qp_type type, uint16_t dlid)
{
	struct end e;
	open_end(&e, type);
	struct info v;
	int s = connect_to(host, port2);
	xfer(s, &v, sizeof v, 0);
	/* Routed to a vRNIC of its own group, with the victim's QP number and PSN. */
	connect_end(&e, dlid, v.qpn, 0, v.psn);
	struct ibv_ah *ah = type == IBV_QPT_UD ? ah_to(&e, dlid) : NULL;
	for (int i = 0; i < 4; i++)
		send_text(&e, "evil", ah, v.qpn, v.qkey, 10 + i);
	struct ibv_wc wc[4];
	int got = poll_for(&e, wc, 4, 5.0);
	for (int i = 0; i < got; i++)
		printf("attacker status %s\n", ibv_wc_status_str(wc[i].status));
	fflush(stdout);
	char done = 'd';
	xfer(s, &done, 1, 1);
	return 0;
}

int main(int argc, char **argv)
{
	if (argc == 5 && !strcmp(argv[1], "victim"))
		return victim(argv[2], argv[3], type_of(argv[4]));
	if (argc == 5 && !strcmp(argv[1], "peer"))
		return peer(argv[2], argv[3], type_of(argv[4]));
	if (argc == 6 && !strcmp(argv[1], "attacker"))
		return attacker(argv[2], argv[3], type_of(argv[4]), atoi(argv[5]));
	fprintf(stderr, "usage: %s victim PORT1 PORT2 TYPE | peer HOST PORT1 TYPE | "
			"attacker HOST PORT2 TYPE DLID\n",
		argv[0]);
	return 2;
}
