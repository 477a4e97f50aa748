/*
 * verbs_semantics: one process, one vRNIC, queue pairs connected to each other on it (the
 * engine treats them exactly like QPs of two vRNICs). Checks real outcomes of the verbs a user
 * of a real RNIC relies on, each as a named case:
 *
 *   verbs_semantics CASE
 *
 * CASE: read_atomics | hammer | validate | rnr | retry | srq | ud | cq_overflow | rereg |
 *       unsignaled | arm_once | ex | reg_contents | isolation | dev_limits | queue_full | fork | event_stress |
 *       resize | gid | dm | big_cq | import |
 *       limits | reg_limit (these two on a
 *       daemon with small limits)
 *
 * Prints "OK <check>" per passed check; exits 1 with "FAIL ..." on the first failure. Every wait
 * is bounded, so a lost completion or event fails instead of hanging.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <sched.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"

#define POLL_SECONDS 20
#define LEN (64u << 10)

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static uint16_t lid;
static union ibv_gid gid;

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
	if (ibv_query_port(ctx, 1, &pa) || ibv_query_gid(ctx, 1, 0, &gid))
		fail("query port/gid");
	lid = pa.lid;
}

static struct ibv_cq *cq_new(int n)
{
	struct ibv_cq *cq = ibv_create_cq(ctx, n, NULL, NULL, 0);
	if (!cq)
		fail("create_cq");
	return cq;
}

static struct ibv_qp *qp_new(struct ibv_cq *cq, enum ibv_qp_type t, struct ibv_srq *srq, int sig_all)
{
	struct ibv_qp_init_attr ia = {
		.send_cq = cq, .recv_cq = cq, .srq = srq, .qp_type = t, .sq_sig_all = sig_all,
		.cap = { .max_send_wr = 64, .max_recv_wr = 64, .max_send_sge = 4, .max_recv_sge = 4 },
	};
	struct ibv_qp *qp = ibv_create_qp(pd, &ia);
	if (!qp)
		fail("create_qp type %d", t);
	return qp;
}

/* RESET -> INIT -> RTR -> RTS for an RC QP to `dqpn` on this vRNIC. */
static void rc_connect(struct ibv_qp *qp, uint32_t dqpn, int rnr_timer, int rnr_retry, int timeout, int retry)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1,
				 .qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
						    IBV_ACCESS_REMOTE_ATOMIC };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
		fail("modify INIT");
	a = (struct ibv_qp_attr){ .qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_4096, .dest_qp_num = dqpn,
				  .max_dest_rd_atomic = 16, .min_rnr_timer = rnr_timer,
				  .ah_attr = { .dlid = lid, .port_num = 1 } };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
					  IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
		fail("modify RTR");
	a = (struct ibv_qp_attr){ .qp_state = IBV_QPS_RTS, .timeout = timeout, .retry_cnt = retry,
				  .rnr_retry = rnr_retry, .max_rd_atomic = 16 };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
					  IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
		fail("modify RTS");
}

static void ud_ready(struct ibv_qp *qp, uint32_t qkey)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1, .qkey = qkey };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY))
		fail("UD INIT");
	a.qp_state = IBV_QPS_RTR;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE))
		fail("UD RTR");
	a.qp_state = IBV_QPS_RTS;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN))
		fail("UD RTS");
}

static int poll_for(struct ibv_cq *cq, struct ibv_wc *wc, double secs)
{
	double deadline = now() + secs;
	for (long i = 0;; i++) {
		int n = ibv_poll_cq(cq, 1, wc);
		if (n < 0)
			fail("poll_cq returned %d", n);
		if (n == 1)
			return 1;
		if ((i & 0xff) == 0xff) {
			if (now() > deadline)
				return 0;
			usleep(50);
		}
	}
}

static struct ibv_wc poll1(struct ibv_cq *cq)
{
	struct ibv_wc wc;
	if (!poll_for(cq, &wc, POLL_SECONDS))
		fail("no completion within %d s", POLL_SECONDS);
	return wc;
}

static void expect(struct ibv_cq *cq, uint64_t wr_id, enum ibv_wc_status st, const char *what)
{
	struct ibv_wc wc = poll1(cq);
	if (wc.wr_id != wr_id || wc.status != st)
		fail("%s: wr %lu %s, expected wr %lu %s", what, (unsigned long)wc.wr_id,
		     ibv_wc_status_str(wc.status), (unsigned long)wr_id, ibv_wc_status_str(st));
	ok("%s: %s", what, ibv_wc_status_str(st));
}

static struct ibv_mr *reg(void *p, size_t n, int acc)
{
	struct ibv_mr *mr = ibv_reg_mr(pd, p, n, acc);
	if (!mr)
		fail("reg_mr");
	return mr;
}

#define ALL_ACCESS (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | \
		    IBV_ACCESS_REMOTE_ATOMIC)

static int post(struct ibv_qp *qp, uint64_t wr_id, enum ibv_wr_opcode op, void *buf, uint32_t len,
		uint32_t lkey, uint64_t raddr, uint32_t rkey, uint64_t cmp, uint64_t swap, int flags)
{
	struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = len, .lkey = lkey };
	struct ibv_send_wr wr = { .wr_id = wr_id, .sg_list = &sge, .num_sge = 1, .opcode = op,
				  .send_flags = flags }, *bad = NULL;
	if (op == IBV_WR_ATOMIC_CMP_AND_SWP || op == IBV_WR_ATOMIC_FETCH_AND_ADD) {
		wr.wr.atomic.remote_addr = raddr;
		wr.wr.atomic.rkey = rkey;
		wr.wr.atomic.compare_add = cmp;
		wr.wr.atomic.swap = swap;
	} else {
		wr.wr.rdma.remote_addr = raddr;
		wr.wr.rdma.rkey = rkey;
	}
	return ibv_post_send(qp, &wr, &bad);
}

static void recv_on(struct ibv_qp *qp, uint64_t wr_id, void *buf, uint32_t len, uint32_t lkey)
{
	struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = len, .lkey = lkey };
	struct ibv_recv_wr wr = { .wr_id = wr_id, .sg_list = &sge, .num_sge = 1 }, *bad;
	if (ibv_post_recv(qp, &wr, &bad))
		fail("post_recv");
}

/* The next async event, within `secs`; returns its type, element in *elem. */
static int async_event(double secs, void **elem)
{
	struct pollfd p = { .fd = ctx->async_fd, .events = POLLIN };
	if (poll(&p, 1, (int)(secs * 1000)) != 1)
		return -1;
	struct ibv_async_event ev;
	if (ibv_get_async_event(ctx, &ev))
		fail("get_async_event");
	int t = ev.event_type;
	*elem = ev.element.qp;
	ibv_ack_async_event(&ev);
	return t;
}

/* Waits for an event of type `want` (skipping others, e.g. PORT_ACTIVE) with element `elem`. */
static void expect_event(int want, void *elem, const char *what)
{
	double deadline = now() + POLL_SECONDS;
	while (now() < deadline) {
		void *e;
		int t = async_event(deadline - now(), &e);
		if (t == want && e == elem) {
			ok("%s: %s", what, ibv_event_type_str(want));
			return;
		}
		if (t < 0)
			break;
	}
	fail("%s: no %s event", what, ibv_event_type_str(want));
}

/* ---- cases ------------------------------------------------------------------------------ */

static void case_read_atomics(void)
{
	struct ibv_cq *cq = cq_new(64);
	struct ibv_qp *a = qp_new(cq, IBV_QPT_RC, NULL, 0), *b = qp_new(cq, IBV_QPT_RC, NULL, 0);
	rc_connect(a, b->qp_num, 12, 7, 14, 7);
	rc_connect(b, a->qp_num, 12, 7, 14, 7);
	uint8_t *src = malloc(LEN + 16), *dst = malloc(LEN + 16);
	uint64_t *word = aligned_alloc(64, 4096), *old = aligned_alloc(64, 4096);
	for (unsigned i = 0; i < LEN; i++)
		src[i + 3] = (uint8_t)(i * 13 + 1);
	memset(dst, 0xEE, LEN + 16);
	struct ibv_mr *ms = reg(src, LEN + 16, ALL_ACCESS), *md = reg(dst, LEN + 16, ALL_ACCESS);
	struct ibv_mr *mw = reg(word, 4096, ALL_ACCESS), *mo = reg(old, 4096, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_mr *mnoatomic = reg(word + 64, 256, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);

	/* READ of odd sizes at odd offsets, byte for byte. */
	unsigned sizes[] = { 1, 7, 4095, 4097, LEN - 5 };
	for (unsigned k = 0; k < sizeof sizes / sizeof *sizes; k++) {
		memset(dst, 0xEE, LEN + 16);
		if (post(a, k, IBV_WR_RDMA_READ, dst + 5, sizes[k], md->lkey, (uintptr_t)(src + 3), ms->rkey, 0,
			 0, IBV_SEND_SIGNALED))
			fail("post READ");
		struct ibv_wc wc = poll1(cq);
		if (wc.status != IBV_WC_SUCCESS || wc.opcode != IBV_WC_RDMA_READ || wc.byte_len != sizes[k])
			fail("READ %u: %s opcode %d byte_len %u", sizes[k], ibv_wc_status_str(wc.status), wc.opcode,
			     wc.byte_len);
		if (memcmp(dst + 5, src + 3, sizes[k]) || dst[4] != 0xEE || dst[5 + sizes[k]] != 0xEE)
			fail("READ %u: bytes differ or spill", sizes[k]);
		ok("READ %u bytes exact, nothing outside", sizes[k]);
	}
	/* FETCH_AND_ADD and CMP_AND_SWP: returned originals and the remote word. */
	word[0] = 0x1122334455667788ull;
	if (post(a, 100, IBV_WR_ATOMIC_FETCH_AND_ADD, old, 8, mo->lkey, (uintptr_t)word, mw->rkey, 0x10, 0,
		 IBV_SEND_SIGNALED))
		fail("post FADD");
	struct ibv_wc wc = poll1(cq);
	if (wc.status || wc.opcode != IBV_WC_FETCH_ADD || old[0] != 0x1122334455667788ull ||
	    word[0] != 0x1122334455667798ull)
		fail("FETCH_AND_ADD: %s old %lx word %lx", ibv_wc_status_str(wc.status), old[0], word[0]);
	ok("FETCH_AND_ADD returns the original and adds");
	if (post(a, 101, IBV_WR_ATOMIC_CMP_AND_SWP, old, 8, mo->lkey, (uintptr_t)word, mw->rkey,
		 0x1122334455667798ull, 42, IBV_SEND_SIGNALED))
		fail("post CAS");
	wc = poll1(cq);
	if (wc.status || wc.opcode != IBV_WC_COMP_SWAP || old[0] != 0x1122334455667798ull || word[0] != 42)
		fail("CMP_AND_SWP hit: old %lx word %lx", old[0], word[0]);
	ok("CMP_AND_SWP with a matching compare swaps");
	if (post(a, 102, IBV_WR_ATOMIC_CMP_AND_SWP, old, 8, mo->lkey, (uintptr_t)word, mw->rkey, 7, 99,
		 IBV_SEND_SIGNALED))
		fail("post CAS miss");
	wc = poll1(cq);
	if (wc.status || old[0] != 42 || word[0] != 42)
		fail("CMP_AND_SWP miss: old %lx word %lx", old[0], word[0]);
	ok("CMP_AND_SWP with another compare leaves the word, returns it");
	/* An atomic on an MR without REMOTE_ATOMIC: REM_ACCESS_ERR, word unchanged. */
	word[64] = 5;
	if (post(a, 103, IBV_WR_ATOMIC_FETCH_AND_ADD, old, 8, mo->lkey, (uintptr_t)(word + 64), mnoatomic->rkey, 1,
		 0, IBV_SEND_SIGNALED))
		fail("post FADD noaccess");
	expect(cq, 103, IBV_WC_REM_ACCESS_ERR, "atomic without REMOTE_ATOMIC");
	if (word[64] != 5)
		fail("word changed by a refused atomic");
	ok("refused atomic changed nothing");
}

/* Two threads, each its own QP pair and CQ, FETCH_AND_ADD the same word: every returned
 * original is distinct and the sum is exact. */
#define HAMMER_N 20000
static uint64_t *hammer_word;
static uint32_t hammer_rkey;
static uint8_t *seen;
static pthread_mutex_t seen_lock = PTHREAD_MUTEX_INITIALIZER;

static void *hammer(void *arg)
{
	(void)arg;
	struct ibv_cq *cq = cq_new(64);
	struct ibv_qp *a = qp_new(cq, IBV_QPT_RC, NULL, 0), *b = qp_new(cq, IBV_QPT_RC, NULL, 0);
	rc_connect(a, b->qp_num, 12, 7, 14, 7);
	rc_connect(b, a->qp_num, 12, 7, 14, 7);
	uint64_t *res = aligned_alloc(64, 16 * 8);
	struct ibv_mr *mr = reg(res, 16 * 8, IBV_ACCESS_LOCAL_WRITE);
	int posted = 0, done = 0, out = 0;
	while (done < HAMMER_N) {
		while (posted < HAMMER_N && out < 16) {
			if (post(a, posted, IBV_WR_ATOMIC_FETCH_AND_ADD, &res[posted % 16], 8, mr->lkey,
				 (uintptr_t)hammer_word, hammer_rkey, 1, 0, IBV_SEND_SIGNALED))
				fail("post hammer");
			posted++;
			out++;
		}
		struct ibv_wc wc = poll1(cq);
		if (wc.status)
			fail("hammer: %s", ibv_wc_status_str(wc.status));
		uint64_t v = res[wc.wr_id % 16];
		if (v >= 2 * HAMMER_N)
			fail("hammer: original %lu out of range", (unsigned long)v);
		pthread_mutex_lock(&seen_lock);
		if (seen[v])
			fail("hammer: original %lu returned twice", (unsigned long)v);
		seen[v] = 1;
		pthread_mutex_unlock(&seen_lock);
		done++;
		out--;
	}
	return NULL;
}

static void case_hammer(void)
{
	hammer_word = aligned_alloc(64, 4096);
	hammer_word[0] = 0;
	hammer_rkey = reg(hammer_word, 4096, ALL_ACCESS)->rkey;
	seen = calloc(2 * HAMMER_N, 1);
	pthread_t t1, t2;
	pthread_create(&t1, NULL, hammer, NULL);
	pthread_create(&t2, NULL, hammer, NULL);
	pthread_join(t1, NULL);
	pthread_join(t2, NULL);
	if (hammer_word[0] != 2 * HAMMER_N)
		fail("hammer: word %lu, expected %u", (unsigned long)hammer_word[0], 2 * HAMMER_N);
	ok("two QPs x %d FETCH_AND_ADD on one word: %lu, every original distinct", HAMMER_N,
	   (unsigned long)hammer_word[0]);
}

static void case_validate(void)
{
	/* The vRNIC's port comes up as the context attaches (element.port_num 1; the shim zeroes
	 * the union, so the pointer view reads 1). */
	expect_event(IBV_EVENT_PORT_ACTIVE, (void *)1, "port 1 up at attach");
	struct ibv_device_attr da;
	if (ibv_query_device(ctx, &da))
		fail("query_device");
	struct ibv_cq *cq = cq_new(16);
	struct ibv_qp_init_attr base = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
					 .cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1,
						  .max_recv_sge = 1 } };
	struct { const char *what; struct ibv_qp_init_attr ia; } over[] = {
		{ "max_send_wr over max_qp_wr", base },
		{ "max_recv_wr over max_qp_wr", base },
		{ "max_send_sge over max_sge", base },
		{ "max_inline_data over the device's", base },
	};
	over[0].ia.cap.max_send_wr = da.max_qp_wr + 1;
	over[1].ia.cap.max_recv_wr = da.max_qp_wr + 1;
	over[2].ia.cap.max_send_sge = da.max_sge + 1;
	over[3].ia.cap.max_inline_data = 1 << 20;
	for (unsigned i = 0; i < 4; i++) {
		errno = 0;
		if (ibv_create_qp(pd, &over[i].ia) || errno != EINVAL)
			fail("%s: not refused with EINVAL", over[i].what);
		ok("%s: EINVAL", over[i].what);
	}
	struct ibv_qp *qp = qp_new(cq, IBV_QPT_RC, NULL, 0);
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1 };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT) != EINVAL)
		fail("RC RESET->INIT without ACCESS_FLAGS accepted");
	ok("RC RESET->INIT without ACCESS_FLAGS: EINVAL");
	a.qp_state = IBV_QPS_RTS;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE) != EINVAL)
		fail("RESET->RTS accepted");
	ok("RESET->RTS: EINVAL");
	a = (struct ibv_qp_attr){ .qp_state = IBV_QPS_INIT, .port_num = 1, .qkey = 1 };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS |
					  IBV_QP_QKEY) != EINVAL)
		fail("RC RESET->INIT with QKEY accepted");
	ok("RC RESET->INIT with a QKEY bit: EINVAL");
	struct ibv_qp *ud = qp_new(cq, IBV_QPT_UD, NULL, 0);
	if (ibv_modify_qp(ud, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) !=
	    EINVAL)
		fail("UD RESET->INIT with ACCESS_FLAGS accepted");
	ok("UD RESET->INIT with ACCESS_FLAGS: EINVAL");
	/* Posting in the wrong state. */
	static uint8_t buf[64];
	struct ibv_mr *mr = reg(buf, sizeof buf, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = 8, .lkey = mr->lkey };
	struct ibv_send_wr wr = { .wr_id = 1, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND }, *bad = NULL;
	if (ibv_post_send(qp, &wr, &bad) != EINVAL || bad != &wr)
		fail("post_send in RESET accepted");
	ok("post_send in RESET: EINVAL, bad_wr set");
	struct ibv_recv_wr rw = { .wr_id = 2, .sg_list = &sge, .num_sge = 1 }, *rbad = NULL;
	if (ibv_post_recv(qp, &rw, &rbad) != EINVAL || rbad != &rw)
		fail("post_recv in RESET accepted");
	ok("post_recv in RESET: EINVAL, bad_wr set");
	rc_connect(qp, qp->qp_num, 12, 7, 14, 7);
	/* Too many SGEs; inline data over the limit. */
	struct ibv_sge many[5] = { sge, sge, sge, sge, sge };
	wr.sg_list = many;
	wr.num_sge = 5;
	bad = NULL;
	if (ibv_post_send(qp, &wr, &bad) != EINVAL || bad != &wr)
		fail("5 SGEs on a 4-SGE QP accepted");
	ok("more SGEs than max_send_sge: EINVAL");
	struct ibv_qp_attr qa;
	struct ibv_qp_init_attr qi;
	if (ibv_query_qp(qp, &qa, IBV_QP_CAP, &qi))
		fail("query_qp");
	uint8_t *big = calloc(1, qi.cap.max_inline_data + 1);
	struct ibv_sge isge = { .addr = (uintptr_t)big, .length = qi.cap.max_inline_data + 1 };
	struct ibv_send_wr iw = { .wr_id = 3, .sg_list = &isge, .num_sge = 1, .opcode = IBV_WR_SEND,
				  .send_flags = IBV_SEND_INLINE };
	bad = NULL;
	if (ibv_post_send(qp, &iw, &bad) != EINVAL)
		fail("inline over max_inline_data (%u) accepted", qi.cap.max_inline_data);
	ok("inline data over max_inline_data (%u): EINVAL", qi.cap.max_inline_data);
	/* CQ and MR edges. */
	errno = 0;
	if (ibv_create_cq(ctx, da.max_cqe + 1, NULL, NULL, 0) || errno != EINVAL)
		fail("CQ over max_cqe accepted");
	ok("CQ deeper than max_cqe: EINVAL");
	if (ibv_resize_cq(cq, da.max_cqe + 1) != EINVAL || ibv_resize_cq(cq, 0) != EINVAL)
		fail("resize_cq past max_cqe or to 0 accepted");
	ok("resize_cq past max_cqe or to 0: EINVAL");
	errno = 0;
	if (ibv_reg_mr(pd, buf, sizeof buf, IBV_ACCESS_REMOTE_WRITE) || errno != EINVAL)
		fail("REMOTE_WRITE without LOCAL_WRITE accepted");
	ok("REMOTE_WRITE without LOCAL_WRITE: EINVAL");
	if (ibv_dealloc_pd(pd) != EBUSY)
		fail("dealloc of a PD in use accepted");
	ok("dealloc_pd in use: EBUSY");
	if (ibv_destroy_cq(cq) != EBUSY)
		fail("destroy of a CQ in use accepted");
	ok("destroy_cq in use: EBUSY");
	struct ibv_srq_init_attr si = { .attr = { .max_wr = da.max_srq_wr + 1, .max_sge = 1 } };
	errno = 0;
	if (ibv_create_srq(pd, &si) || errno != EINVAL)
		fail("SRQ over max_srq_wr accepted");
	ok("SRQ deeper than max_srq_wr: EINVAL");
	struct ibv_ah_attr aa = { .dlid = lid, .port_num = 2 };
	errno = 0;
	if (ibv_create_ah(pd, &aa) || errno != EINVAL)
		fail("AH on port 2 accepted");
	ok("AH on a port that does not exist: EINVAL");
}

/* A peer that never posts a receive: RNR_RETRY_EXC_ERR after the configured retries. */
static void case_rnr(void)
{
	struct ibv_cq *cq = cq_new(16);
	struct ibv_qp *a = qp_new(cq, IBV_QPT_RC, NULL, 0), *b = qp_new(cq, IBV_QPT_RC, NULL, 0);
	rc_connect(a, b->qp_num, 1, 2, 14, 7);
	rc_connect(b, a->qp_num, 1, 2, 14, 7);
	static uint8_t buf[64];
	struct ibv_mr *mr = reg(buf, sizeof buf, IBV_ACCESS_LOCAL_WRITE);
	double t0 = now();
	if (post(a, 7, IBV_WR_SEND, buf, 16, mr->lkey, 0, 0, 0, 0, IBV_SEND_SIGNALED))
		fail("post");
	expect(cq, 7, IBV_WC_RNR_RETRY_EXC_ERR, "send to a QP with no receive, rnr_retry 2");
	ok("failed after %.1f ms", (now() - t0) * 1e3);
	/* rnr_retry 7 = forever: the send waits until a receive comes, however late. */
	struct ibv_qp *c = qp_new(cq, IBV_QPT_RC, NULL, 0), *d = qp_new(cq, IBV_QPT_RC, NULL, 0);
	rc_connect(c, d->qp_num, 1, 7, 14, 7);
	rc_connect(d, c->qp_num, 1, 7, 14, 7);
	if (post(c, 8, IBV_WR_SEND, buf, 16, mr->lkey, 0, 0, 0, 0, IBV_SEND_SIGNALED))
		fail("post");
	struct ibv_wc wc;
	if (poll_for(cq, &wc, 0.5))
		fail("rnr_retry 7 completed early: %s", ibv_wc_status_str(wc.status));
	recv_on(d, 9, buf + 32, 32, mr->lkey);
	wc = poll1(cq);
	struct ibv_wc wc2 = poll1(cq);
	if (wc.status || wc2.status)
		fail("late receive: %s / %s", ibv_wc_status_str(wc.status), ibv_wc_status_str(wc2.status));
	ok("rnr_retry 7 waits 0.5 s and succeeds once a receive is posted");
}

/* A peer that is gone: RETRY_EXC_ERR after timeout x retry_cnt. */
static void case_retry(void)
{
	struct ibv_cq *cq = cq_new(16);
	struct ibv_qp *a = qp_new(cq, IBV_QPT_RC, NULL, 0), *b = qp_new(cq, IBV_QPT_RC, NULL, 0);
	uint32_t gone = b->qp_num;
	if (ibv_destroy_qp(b))
		fail("destroy_qp");
	rc_connect(a, gone, 12, 7, 10, 2); /* 4.096 us * 2^10 = 4.2 ms per try, 3 tries */
	static uint8_t buf[64];
	struct ibv_mr *mr = reg(buf, sizeof buf, IBV_ACCESS_LOCAL_WRITE);
	double t0 = now();
	if (post(a, 11, IBV_WR_SEND, buf, 16, mr->lkey, 0, 0, 0, 0, IBV_SEND_SIGNALED))
		fail("post");
	expect(cq, 11, IBV_WC_RETRY_EXC_ERR, "send to a destroyed QP");
	double ms = (now() - t0) * 1e3;
	if (ms < 5)
		fail("failed after %.1f ms, before timeout x (retry_cnt+1)", ms);
	ok("failed after %.1f ms", ms);
	expect_event(IBV_EVENT_QP_FATAL, a, "requester QP fatal event");
}

static void case_srq(void)
{
	struct ibv_cq *cq = cq_new(128);
	struct ibv_srq_init_attr si = { .attr = { .max_wr = 32, .max_sge = 2 } };
	struct ibv_srq *srq = ibv_create_srq(pd, &si);
	if (!srq)
		fail("create_srq");
	struct ibv_qp *r1 = qp_new(cq, IBV_QPT_RC, srq, 0), *r2 = qp_new(cq, IBV_QPT_RC, srq, 0);
	struct ibv_qp *s1 = qp_new(cq, IBV_QPT_RC, NULL, 0), *s2 = qp_new(cq, IBV_QPT_RC, NULL, 0);
	rc_connect(s1, r1->qp_num, 12, 7, 14, 7);
	rc_connect(r1, s1->qp_num, 12, 7, 14, 7);
	rc_connect(s2, r2->qp_num, 12, 7, 14, 7);
	rc_connect(r2, s2->qp_num, 12, 7, 14, 7);
	uint8_t *buf = calloc(1, 8192);
	struct ibv_mr *mr = reg(buf, 8192, IBV_ACCESS_LOCAL_WRITE);
	for (int i = 0; i < 4; i++)
		buf[i * 64] = 0xA0 + i;
	for (int i = 0; i < 6; i++) {
		struct ibv_sge sge = { .addr = (uintptr_t)(buf + 4096 + i * 256), .length = 256, .lkey = mr->lkey };
		struct ibv_recv_wr wr = { .wr_id = 1000 + i, .sg_list = &sge, .num_sge = 1 }, *bad;
		if (ibv_post_srq_recv(srq, &wr, &bad))
			fail("post_srq_recv");
	}
	struct ibv_recv_wr *rbad;
	struct ibv_sge rs = { .addr = (uintptr_t)buf, .length = 8, .lkey = mr->lkey };
	struct ibv_recv_wr rw = { .sg_list = &rs, .num_sge = 1 };
	if (ibv_post_recv(r1, &rw, &rbad) != EINVAL)
		fail("post_recv on a QP with an SRQ accepted");
	ok("post_recv on a QP attached to an SRQ: EINVAL");
	struct ibv_srq_attr sa = { .srq_limit = 3 };
	if (ibv_modify_srq(srq, &sa, IBV_SRQ_LIMIT))
		fail("modify_srq limit");
	if (ibv_query_srq(srq, &sa) || sa.srq_limit != 3 || sa.max_wr < 32)
		fail("query_srq: limit %u max_wr %u", sa.srq_limit, sa.max_wr);
	ok("query_srq: limit 3 armed, max_wr %u", sa.max_wr);
	struct ibv_device_attr dattr;
	if (ibv_query_device(ctx, &dattr))
		fail("query_device");
	sa.max_wr = dattr.max_srq_wr + 1;
	if (ibv_modify_srq(srq, &sa, IBV_SRQ_MAX_WR) != EINVAL)
		fail("SRQ resize past max_srq_wr accepted");
	ok("SRQ resize past max_srq_wr: EINVAL");
	/* Two senders on two QPs, receives from the one SRQ, completions name the right QP. */
	for (int i = 0; i < 4; i++) {
		struct ibv_qp *s = i % 2 ? s2 : s1;
		if (post(s, i, IBV_WR_SEND, buf + i * 64, 64, mr->lkey, 0, 0, 0, 0, IBV_SEND_SIGNALED))
			fail("post");
	}
	int got_recv = 0, got_send = 0;
	uint32_t by_qp[2] = { 0, 0 };
	while (got_recv + got_send < 8) {
		struct ibv_wc wc = poll1(cq);
		if (wc.status)
			fail("SRQ traffic: %s", ibv_wc_status_str(wc.status));
		if (wc.opcode == IBV_WC_RECV) {
			uint8_t *at = buf + 4096 + (wc.wr_id - 1000) * 256;
			if (wc.byte_len != 64 || (at[0] & 0xF0) != 0xA0)
				fail("SRQ receive %lu: byte_len %u first byte %x", (unsigned long)wc.wr_id, wc.byte_len,
				     at[0]);
			if (wc.qp_num == r1->qp_num)
				by_qp[0]++;
			else if (wc.qp_num == r2->qp_num)
				by_qp[1]++;
			else
				fail("SRQ receive on QP %u", wc.qp_num);
			got_recv++;
		} else {
			got_send++;
		}
	}
	if (by_qp[0] != 2 || by_qp[1] != 2)
		fail("receives per QP %u/%u", by_qp[0], by_qp[1]);
	ok("4 sends over 2 QPs land in SRQ receives, 2 per QP, bytes right");
	expect_event(IBV_EVENT_SRQ_LIMIT_REACHED, srq, "2 receives left under limit 3");
	if (ibv_query_srq(srq, &sa) || sa.srq_limit != 0)
		fail("limit still armed after the event: %u", sa.srq_limit);
	ok("limit disarmed after the event");
	if (ibv_destroy_srq(srq) != EBUSY)
		fail("destroy of an SRQ in use accepted");
	ok("destroy_srq in use: EBUSY");
	/* An SRQ QP moved to ERR reports LAST_WQE_REACHED; the SRQ's receives stay. */
	struct ibv_qp_attr ea = { .qp_state = IBV_QPS_ERR };
	if (ibv_modify_qp(r1, &ea, IBV_QP_STATE))
		fail("modify ERR");
	expect_event(IBV_EVENT_QP_LAST_WQE_REACHED, r1, "SRQ QP to ERR");
	if (post(s2, 9, IBV_WR_SEND, buf, 64, mr->lkey, 0, 0, 0, 0, IBV_SEND_SIGNALED))
		fail("post");
	struct ibv_wc w1 = poll1(cq), w2 = poll1(cq);
	if (w1.status || w2.status)
		fail("after r1 ERR: %s %s", ibv_wc_status_str(w1.status), ibv_wc_status_str(w2.status));
	ok("the SRQ still serves r2 after r1 went to ERR");
	if (ibv_destroy_qp(r1) || ibv_destroy_qp(r2) || ibv_destroy_srq(srq))
		fail("destroy QPs then SRQ");
	ok("destroy_srq once unused");
}

static void case_ud(void)
{
	struct ibv_cq *cq = cq_new(64);
	struct ibv_qp *a = qp_new(cq, IBV_QPT_UD, NULL, 0), *b = qp_new(cq, IBV_QPT_UD, NULL, 0);
	ud_ready(a, 0x1111);
	ud_ready(b, 0x2222);
	uint8_t *buf = calloc(1, 16384);
	struct ibv_mr *mr = reg(buf, 16384, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_ah_attr aa = { .is_global = 1, .port_num = 1, .grh = { .dgid = gid, .hop_limit = 1 } };
	struct ibv_ah *ah = ibv_create_ah(pd, &aa);
	struct ibv_ah_attr la = { .dlid = lid, .port_num = 1 };
	struct ibv_ah *ah_lid = ibv_create_ah(pd, &la);
	if (!ah || !ah_lid)
		fail("create_ah");
	for (int i = 0; i < 100; i++)
		buf[i] = (uint8_t)(i + 1);
	struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = 100, .lkey = mr->lkey };
	struct ibv_send_wr wr = { .wr_id = 1, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND_WITH_IMM,
				  .send_flags = IBV_SEND_SIGNALED, .imm_data = htonl(77) }, *bad;
	wr.wr.ud.ah = ah;
	wr.wr.ud.remote_qpn = b->qp_num;
	wr.wr.ud.remote_qkey = 0x2222;
	recv_on(b, 50, buf + 4096, 4096 + 40, mr->lkey);
	if (ibv_post_send(a, &wr, &bad))
		fail("UD post_send");
	struct ibv_wc w1 = poll1(cq), w2 = poll1(cq);
	struct ibv_wc rc = w1.opcode == IBV_WC_RECV ? w1 : w2;
	if (w1.status || w2.status || rc.opcode != IBV_WC_RECV)
		fail("UD send: %s %s", ibv_wc_status_str(w1.status), ibv_wc_status_str(w2.status));
	struct ibv_grh *g = (struct ibv_grh *)(buf + 4096);
	if (rc.byte_len != 140 || !(rc.wc_flags & IBV_WC_GRH) || !(rc.wc_flags & IBV_WC_WITH_IMM) ||
	    ntohl(rc.imm_data) != 77 || rc.src_qp != a->qp_num || rc.slid != lid)
		fail("UD receive: byte_len %u flags %x imm %u src_qp %u slid %u", rc.byte_len, rc.wc_flags,
		     ntohl(rc.imm_data), rc.src_qp, rc.slid);
	if (memcmp(buf + 4096 + 40, buf, 100) || memcmp(&g->sgid, &gid, 16) || memcmp(&g->dgid, &gid, 16) ||
	    (ntohl(g->version_tclass_flow) >> 28) != 6)
		fail("UD payload or GRH wrong");
	ok("UD SEND_WITH_IMM: 40-byte GRH (IPv6 version, SGID, DGID), payload after it, byte_len 140, "
	   "src_qp, slid, imm");
	struct ibv_ah_attr back;
	if (ibv_init_ah_from_wc(ctx, 1, &rc, g, &back) || !back.is_global ||
	    memcmp(&back.grh.dgid, &gid, 16) || back.dlid != lid)
		fail("init_ah_from_wc");
	struct ibv_ah *reply = ibv_create_ah_from_wc(pd, &rc, g, 1);
	if (!reply)
		fail("create_ah_from_wc");
	ok("init_ah_from_wc / create_ah_from_wc answer the sender");
	/* Wrong Q_Key: silently dropped, the sender still succeeds. */
	wr.wr.ud.remote_qkey = 0x3333;
	wr.wr_id = 2;
	wr.wr.ud.ah = ah_lid;
	if (ibv_post_send(a, &wr, &bad))
		fail("post");
	expect(cq, 2, IBV_WC_SUCCESS, "UD send with a wrong Q_Key completes at the sender");
	struct ibv_wc extra;
	if (poll_for(cq, &extra, 0.3))
		fail("wrong Q_Key delivered: wr %lu", (unsigned long)extra.wr_id);
	ok("wrong Q_Key: nothing delivered");
	/* The high bit means "my own Q_Key": a's is 0x1111, b's 0x2222 -> dropped; to a itself -> lands. */
	struct ibv_qp *c = qp_new(cq, IBV_QPT_UD, NULL, 0);
	ud_ready(c, 0x1111);
	recv_on(c, 51, buf + 8192, 4096 + 40, mr->lkey);
	wr.wr.ud.remote_qpn = c->qp_num;
	wr.wr.ud.remote_qkey = 0x80000000;
	wr.wr_id = 3;
	if (ibv_post_send(a, &wr, &bad))
		fail("post");
	w1 = poll1(cq);
	w2 = poll1(cq);
	rc = w1.opcode == IBV_WC_RECV ? w1 : w2;
	if (w1.status || w2.status || rc.wr_id != 51 || (rc.wc_flags & IBV_WC_GRH))
		fail("own Q_Key send: %s %s flags %x", ibv_wc_status_str(w1.status), ibv_wc_status_str(w2.status),
		     rc.wc_flags);
	ok("Q_Key with the high bit uses the sender's Q_Key; LID-routed datagram has no GRH");
	/* Receive buffer without room for GRH + payload: LOC_LEN_ERR at the receiver only. */
	recv_on(c, 52, buf + 8192, 100, mr->lkey);
	wr.wr_id = 4;
	if (ibv_post_send(a, &wr, &bad))
		fail("post");
	w1 = poll1(cq);
	w2 = poll1(cq);
	rc = w1.opcode == IBV_WC_RECV || w1.wr_id == 52 ? w1 : w2;
	struct ibv_wc sc = rc.wr_id == w1.wr_id ? w2 : w1;
	if (rc.wr_id != 52 || rc.status != IBV_WC_LOC_LEN_ERR || sc.status != IBV_WC_SUCCESS)
		fail("short UD receive: wr %lu %s / sender %s", (unsigned long)rc.wr_id,
		     ibv_wc_status_str(rc.status), ibv_wc_status_str(sc.status));
	ok("UD receive without 40 + payload bytes: LOC_LEN_ERR there, the sender succeeds");
	/* Over the MTU: LOC_LEN_ERR at the sender. */
	sge.length = 4097;
	wr.wr_id = 5;
	if (ibv_post_send(a, &wr, &bad))
		fail("post");
	expect(cq, 5, IBV_WC_LOC_LEN_ERR, "UD send of 4097 bytes over a 4096 MTU");
	if (ibv_destroy_ah(ah) || ibv_destroy_ah(ah_lid) || ibv_destroy_ah(reply))
		fail("destroy_ah");
	ok("destroy_ah");
}

/* A CQ that overflows raises IBV_EVENT_CQ_ERR. */
static void case_cq_overflow(void)
{
	struct ibv_cq *cq = cq_new(1);
	int depth = cq->cqe;
	struct ibv_qp *a = qp_new(cq, IBV_QPT_RC, NULL, 1);
	rc_connect(a, a->qp_num, 12, 7, 14, 7);
	static uint64_t w[8];
	struct ibv_mr *mr = reg(w, sizeof w, ALL_ACCESS);
	for (int i = 0; i < depth + 2; i++)
		if (post(a, i, IBV_WR_RDMA_WRITE, w, 8, mr->lkey, (uintptr_t)(w + 1), mr->rkey, 0, 0, 0))
			fail("post");
	expect_event(IBV_EVENT_CQ_ERR, cq, "CQ given more completions than its depth");
}

/* rereg_mr: new access flags take effect with the same keys; a new range gets new keys. */
static void case_rereg(void)
{
	struct ibv_cq *cq = cq_new(16);
	struct ibv_qp *a = qp_new(cq, IBV_QPT_RC, NULL, 0), *b = qp_new(cq, IBV_QPT_RC, NULL, 0);
	rc_connect(a, b->qp_num, 12, 7, 14, 7);
	rc_connect(b, a->qp_num, 12, 7, 14, 7);
	uint8_t *src = calloc(1, 4096), *t1 = calloc(1, 8192), *t2 = calloc(1, 8192);
	memset(src, 0x5A, 64);
	struct ibv_mr *ms = reg(src, 4096, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_mr *mt = reg(t1, 8192, IBV_ACCESS_LOCAL_WRITE);
	uint32_t key = mt->rkey;
	if (ibv_rereg_mr(mt, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0,
			 IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE))
		fail("rereg access");
	if (mt->rkey != key)
		fail("rkey changed by an access change");
	if (post(a, 1, IBV_WR_RDMA_WRITE, src, 64, ms->lkey, (uintptr_t)t1, mt->rkey, 0, 0, IBV_SEND_SIGNALED))
		fail("post");
	expect(cq, 1, IBV_WC_SUCCESS, "write after rereg granted REMOTE_WRITE");
	if (t1[0] != 0x5A || t1[63] != 0x5A)
		fail("bytes did not land");
	if (ibv_rereg_mr(mt, IBV_REREG_MR_CHANGE_TRANSLATION, NULL, t2, 8192, 0))
		fail("rereg translation");
	if (mt->addr != t2 || mt->length != 8192)
		fail("rereg did not update addr/length");
	ok("rereg translation: now %p, keys %x/%x", mt->addr, mt->lkey, mt->rkey);
	memset(src, 0x6B, 64);
	if (post(a, 2, IBV_WR_RDMA_WRITE, src, 64, ms->lkey, (uintptr_t)t2, mt->rkey, 0, 0, IBV_SEND_SIGNALED))
		fail("post");
	expect(cq, 2, IBV_WC_SUCCESS, "write into the new range");
	if (t2[0] != 0x6B || t1[0] != 0x5A)
		fail("bytes after rereg: new %x old %x", t2[0], t1[0]);
	ok("bytes land in the new range; the old buffer keeps its bytes");
	if (ibv_rereg_mr(mt, IBV_REREG_MR_CHANGE_TRANSLATION, NULL, NULL, 0, 0) != IBV_REREG_MR_ERR_INPUT)
		fail("rereg translation to NULL accepted");
	ok("rereg to a NULL range: IBV_REREG_MR_ERR_INPUT");
	if (ibv_dereg_mr(mt))
		fail("dereg");
}

/* sq_sig_all = 0: only signaled sends complete; unsignaled ones still execute in order. */
static void case_unsignaled(void)
{
	struct ibv_cq *cq = cq_new(16);
	struct ibv_qp *a = qp_new(cq, IBV_QPT_RC, NULL, 0);
	rc_connect(a, a->qp_num, 12, 7, 14, 7);
	static uint64_t w[16];
	struct ibv_mr *mr = reg(w, sizeof w, ALL_ACCESS);
	for (int i = 0; i < 4; i++) {
		w[i] = 100 + i;
		if (post(a, i, IBV_WR_RDMA_WRITE, &w[i], 8, mr->lkey, (uintptr_t)&w[8], mr->rkey, 0, 0,
			 (i == 3 ? IBV_SEND_SIGNALED : 0) | (i == 2 ? IBV_SEND_FENCE : 0)))
			fail("post");
	}
	expect(cq, 3, IBV_WC_SUCCESS, "the one signaled write of four");
	struct ibv_wc extra;
	if (poll_for(cq, &extra, 0.2))
		fail("an unsignaled write completed: wr %lu", (unsigned long)extra.wr_id);
	if (w[8] != 103)
		fail("writes out of order: %lu", (unsigned long)w[8]);
	ok("unsignaled writes give no completion and ran in order (last value 103)");
}

/* ---- one arm, one event: an app that arms its CQ once and then busy-polls -------------------- */

/* Events on `ch` for `cq` within `secs` of the first one (0 if none comes in `first_secs`). */
static int count_events(struct ibv_comp_channel *ch, struct ibv_cq *cq, double first_secs, double secs)
{
	struct pollfd p = { .fd = ch->fd, .events = POLLIN };
	if (poll(&p, 1, (int)(first_secs * 1000)) != 1)
		return 0;
	int n = 0;
	double end = now() + secs;
	while (now() < end) {
		struct ibv_cq *ev;
		void *ectx;
		if (ibv_get_cq_event(ch, &ev, &ectx)) {
			if (errno != EAGAIN)
				fail("get_cq_event: %s", strerror(errno));
			usleep(1000);
			continue;
		}
		if (ev != cq)
			fail("an event for another CQ");
		ibv_ack_cq_events(cq, 1);
		n++;
	}
	return n;
}

static void case_arm_once(void)
{
	struct ibv_comp_channel *ch = ibv_create_comp_channel(ctx);
	if (!ch)
		fail("create_comp_channel");
	int fl = fcntl(ch->fd, F_GETFL);
	if (fl < 0 || fcntl(ch->fd, F_SETFL, fl | O_NONBLOCK))
		fail("O_NONBLOCK on the channel");
	struct ibv_cq *cq = ibv_create_cq(ctx, 64, NULL, ch, 0);
	if (!cq)
		fail("create_cq");
	struct ibv_qp *a = qp_new(cq, IBV_QPT_RC, NULL, 1);
	struct ibv_qp *b = qp_new(cq, IBV_QPT_RC, NULL, 1);
	rc_connect(a, b->qp_num, 12, 7, 14, 7);
	rc_connect(b, a->qp_num, 12, 7, 14, 7);
	static uint64_t w[2];
	struct ibv_mr *mr = reg(w, sizeof w, ALL_ACCESS);
	/* Armed once, then 501 messages, each polled as soon as it completes (as UCX, which arms
	 * now and then and keeps polling). A device raises one event for the arm, whatever the
	 * completions after it. */
	if (ibv_req_notify_cq(cq, 0))
		fail("req_notify_cq");
	for (int i = 0; i < 500; i++) {
		recv_on(b, 2 * i + 1, &w[1], 8, mr->lkey);
		w[0] = i;
		if (post(a, 2 * i, IBV_WR_SEND, &w[0], 8, mr->lkey, 0, 0, 0, 0, IBV_SEND_SIGNALED))
			fail("post_send");
		struct ibv_wc wc;
		for (int k = 0; k < 2; k++) {
			wc = poll1(cq);
			if (wc.status != IBV_WC_SUCCESS)
				fail("message %d: %s", i, ibv_wc_status_str(wc.status));
		}
		if (w[1] != (uint64_t)i)
			fail("message %d: received %lu", i, (unsigned long)w[1]);
	}
	/* The arm's first event had its completion polled before the driver's notifier saw it:
	 * hidden, and the CQ armed again (cq_events.rs). A notifier kept off the cores until the
	 * loop ended (two busy threads and the engine on a 2-core machine) does that after the last
	 * completion, so one more message, once it has had time, raises the event the arm owes. */
	usleep(200 * 1000);
	recv_on(b, 1001, &w[1], 8, mr->lkey);
	if (post(a, 1000, IBV_WR_SEND, &w[0], 8, mr->lkey, 0, 0, 0, 0, IBV_SEND_SIGNALED))
		fail("post_send");
	for (int k = 0; k < 2; k++)
		if (poll1(cq).status != IBV_WC_SUCCESS)
			fail("the last message");
	int n = count_events(ch, cq, 2.0, 0.3);
	if (n != 1)
		fail("one arm, 1002 completions polled by the app: %d events, a device raises 1", n);
	ok("one arm, 1002 completions polled by the app: exactly one event, as on a device");
	/* Armed again, an app that waits on the channel gets its event. */
	if (ibv_req_notify_cq(cq, 0))
		fail("req_notify_cq");
	recv_on(b, 9001, &w[1], 8, mr->lkey);
	if (post(a, 9000, IBV_WR_SEND, &w[0], 8, mr->lkey, 0, 0, 0, 0, IBV_SEND_SIGNALED))
		fail("post_send");
	n = count_events(ch, cq, 5.0, 0.3);
	if (n < 1)
		fail("armed again and waiting: no event");
	struct ibv_wc wc;
	int got = 0;
	while (got < 2 && poll_for(cq, &wc, 2.0))
		got += wc.status == IBV_WC_SUCCESS;
	if (got != 2)
		fail("armed again: %d of 2 completions", got);
	ok("armed again, the waiting app gets its event and both completions");
}

/* ---- the extended API: ibv_wr_* on a QP from ibv_create_qp_ex, ibv_cq_ex polling ---------- */

static struct ibv_cq_ex *cqx_new(void)
{
	struct ibv_cq_init_attr_ex ca = { .cqe = 64, .wc_flags = IBV_WC_STANDARD_FLAGS |
						      IBV_WC_EX_WITH_COMPLETION_TIMESTAMP };
	struct ibv_cq_ex *cq = ibv_create_cq_ex(ctx, &ca);
	if (!cq)
		fail("create_cq_ex");
	return cq;
}

static struct ibv_qp *qpx_new(struct ibv_cq_ex *cq)
{
	struct ibv_qp_init_attr_ex ia = {
		.send_cq = ibv_cq_ex_to_cq(cq), .recv_cq = ibv_cq_ex_to_cq(cq), .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 32, .max_recv_wr = 32, .max_send_sge = 4, .max_recv_sge = 4,
			 .max_inline_data = 64 },
		.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS, .pd = pd,
		.send_ops_flags = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM | IBV_QP_EX_WITH_RDMA_WRITE |
				  IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM | IBV_QP_EX_WITH_RDMA_READ |
				  IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP | IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD,
	};
	struct ibv_qp *qp = ibv_create_qp_ex(ctx, &ia);
	if (!qp)
		fail("create_qp_ex");
	return qp;
}

struct cx { uint64_t wr_id; int status, opcode; uint32_t byte_len, imm, qp_num, src_qp, flags; uint64_t ts; };

/* Polls one completion through start_poll/end_poll, reading every field. */
static struct cx pollx(struct ibv_cq_ex *cq)
{
	struct ibv_poll_cq_attr pa = {};
	double deadline = now() + POLL_SECONDS;
	int rc;
	while ((rc = ibv_start_poll(cq, &pa)) == ENOENT)
		if (now() > deadline)
			fail("no extended completion within %d s", POLL_SECONDS);
	if (rc)
		fail("start_poll %d", rc);
	struct cx c = { cq->wr_id, cq->status, ibv_wc_read_opcode(cq), ibv_wc_read_byte_len(cq),
			ibv_wc_read_imm_data(cq), ibv_wc_read_qp_num(cq), ibv_wc_read_src_qp(cq),
			ibv_wc_read_wc_flags(cq), ibv_wc_read_completion_ts(cq) };
	ibv_end_poll(cq);
	return c;
}

static void case_ex(void)
{
	struct ibv_device_attr_ex dx;
	if (ibv_query_device_ex(ctx, NULL, &dx) || !dx.completion_timestamp_mask || !dx.hca_core_clock)
		fail("query_device_ex: no completion timestamps");
	ok("query_device_ex: timestamp mask %lx, clock %lu kHz", (unsigned long)dx.completion_timestamp_mask,
	   (unsigned long)dx.hca_core_clock);
	struct ibv_cq_ex *cq = cqx_new();
	struct ibv_qp *a = qpx_new(cq), *b = qpx_new(cq);
	rc_connect(a, b->qp_num, 12, 7, 14, 7);
	rc_connect(b, a->qp_num, 12, 7, 14, 7);
	struct ibv_qp_ex *x = ibv_qp_to_qp_ex(a);
	if (!x)
		fail("qp_to_qp_ex");
	struct ibv_qp *plain = qp_new(ibv_cq_ex_to_cq(cq), IBV_QPT_RC, NULL, 0);
	if (ibv_qp_to_qp_ex(plain))
		fail("qp_to_qp_ex of a plain QP");
	ok("qp_to_qp_ex: the extended QP's table; NULL for a plain QP");
	uint8_t *src = calloc(1, 8192), *dst = calloc(1, 8192);
	uint64_t *word = aligned_alloc(64, 4096), *old = aligned_alloc(64, 64);
	struct ibv_mr *ms = reg(src, 8192, ALL_ACCESS), *md = reg(dst, 8192, ALL_ACCESS);
	struct ibv_mr *mw = reg(word, 4096, ALL_ACCESS), *mo = reg(old, 64, IBV_ACCESS_LOCAL_WRITE);
	for (int i = 0; i < 8192; i++)
		src[i] = (uint8_t)(i * 3 + 1);
	/* One batch: a write from three SGEs, a write with imm, a send with imm from an inline list. */
	recv_on(b, 500, dst + 4096, 256, md->lkey);
	recv_on(b, 501, dst + 4096 + 256, 256, md->lkey);
	struct ibv_sge three[3] = { { (uintptr_t)src, 10, ms->lkey }, { (uintptr_t)src + 100, 20, ms->lkey },
				    { (uintptr_t)src + 1000, 30, ms->lkey } };
	ibv_wr_start(x);
	x->wr_id = 1;
	x->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_write(x, md->rkey, (uintptr_t)dst);
	ibv_wr_set_sge_list(x, 3, three);
	x->wr_id = 2;
	ibv_wr_rdma_write_imm(x, md->rkey, (uintptr_t)dst + 100, htonl(0xabc));
	ibv_wr_set_sge(x, ms->lkey, (uintptr_t)src + 2000, 40);
	x->wr_id = 3;
	x->wr_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
	ibv_wr_send_imm(x, htonl(7));
	struct ibv_data_buf bufs[2] = { { src + 3000, 5 }, { src + 4000, 6 } };
	ibv_wr_set_inline_data_list(x, 2, bufs);
	if (ibv_wr_complete(x))
		fail("wr_complete of a batch of three");
	int seen[4] = { 0 };
	for (int i = 0; i < 5; i++) {
		struct cx c = pollx(cq);
		if (c.status)
			fail("batch completion wr %lu: %s", (unsigned long)c.wr_id, ibv_wc_status_str(c.status));
		if (c.wr_id == 500) {
			if (c.opcode != IBV_WC_RECV_RDMA_WITH_IMM || ntohl(c.imm) != 0xabc || c.byte_len != 40 ||
			    !(c.flags & IBV_WC_WITH_IMM) || c.qp_num != b->qp_num || c.src_qp != a->qp_num)
				fail("write_imm receive: opcode %d imm %x len %u flags %x", c.opcode, ntohl(c.imm),
				     c.byte_len, c.flags);
			seen[0] = 1;
		} else if (c.wr_id == 501) {
			if (c.opcode != IBV_WC_RECV || ntohl(c.imm) != 7 || c.byte_len != 11)
				fail("send_imm receive: opcode %d imm %u len %u", c.opcode, ntohl(c.imm), c.byte_len);
			seen[1] = 1;
		} else if (c.wr_id == 1 || c.wr_id == 2 || c.wr_id == 3) {
			if (c.qp_num != a->qp_num)
				fail("send completion qp_num %u", c.qp_num);
			seen[2]++;
		}
		if (!c.ts)
			fail("completion without a timestamp");
	}
	if (!seen[0] || !seen[1] || seen[2] != 3)
		fail("batch completions missing");
	if (memcmp(dst, src, 10) || memcmp(dst + 10, src + 100, 20) || memcmp(dst + 30, src + 1000, 30) ||
	    memcmp(dst + 100, src + 2000, 40) || memcmp(dst + 4096 + 256, src + 3000, 5) ||
	    memcmp(dst + 4096 + 256 + 5, src + 4000, 6))
		fail("batch bytes wrong");
	ok("one batch: write from 3 SGEs, write_imm, send_imm from an inline list: bytes, opcodes, imm, lengths");
	/* READ and both atomics. */
	word[0] = 40;
	ibv_wr_start(x);
	x->wr_flags = IBV_SEND_SIGNALED;
	x->wr_id = 10;
	ibv_wr_rdma_read(x, ms->rkey, (uintptr_t)src + 5000);
	ibv_wr_set_sge(x, md->lkey, (uintptr_t)dst + 6000, 100);
	x->wr_id = 11;
	ibv_wr_atomic_fetch_add(x, mw->rkey, (uintptr_t)word, 2);
	ibv_wr_set_sge(x, mo->lkey, (uintptr_t)old, 8);
	x->wr_id = 12;
	ibv_wr_atomic_cmp_swp(x, mw->rkey, (uintptr_t)word, 42, 99);
	ibv_wr_set_sge(x, mo->lkey, (uintptr_t)(old + 1), 8);
	if (ibv_wr_complete(x))
		fail("wr_complete read/atomics");
	uint64_t prev_ts = 0;
	for (int i = 0; i < 3; i++) {
		struct cx c = pollx(cq);
		if (c.status || c.wr_id != (uint64_t)(10 + i))
			fail("read/atomic wr %lu %s", (unsigned long)c.wr_id, ibv_wc_status_str(c.status));
		if (c.ts < prev_ts)
			fail("timestamps go backwards");
		prev_ts = c.ts;
	}
	if (memcmp(dst + 6000, src + 5000, 100) || old[0] != 40 || old[1] != 42 || word[0] != 99)
		fail("read/atomics results: old %lu %lu word %lu", (unsigned long)old[0], (unsigned long)old[1],
		     (unsigned long)word[0]);
	ok("wr_rdma_read, wr_atomic_fetch_add, wr_atomic_cmp_swp: bytes and originals; timestamps in order");
	/* wr_abort posts nothing; an unsupported builder fails the whole batch. */
	ibv_wr_start(x);
	x->wr_id = 20;
	ibv_wr_send(x);
	ibv_wr_set_sge(x, ms->lkey, (uintptr_t)src, 8);
	ibv_wr_abort(x);
	ibv_wr_start(x);
	x->wr_id = 21;
	ibv_wr_rdma_write(x, md->rkey, (uintptr_t)dst);
	ibv_wr_set_sge(x, ms->lkey, (uintptr_t)src, 8);
	/* TSO: an Ethernet feature no RC QP has (ATOMIC_WRITE is supported now: ex_check.c). */
	static uint8_t hdr[64];
	ibv_wr_send_tso(x, hdr, sizeof hdr, 1024);
	ibv_wr_set_sge(x, ms->lkey, (uintptr_t)src, 8);
	int rc = ibv_wr_complete(x);
	if (rc != EOPNOTSUPP && rc != EINVAL)
		fail("a batch with wr_send_tso: %d", rc);
	struct ibv_poll_cq_attr pa = {};
	usleep(100000);
	if (ibv_start_poll(cq, &pa) != ENOENT)
		fail("aborted or failed batch posted something: wr %lu", (unsigned long)cq->wr_id);
	ok("wr_abort posts nothing; a batch with wr_send_tso fails (%s) and posts nothing", strerror(rc));
	/* The plain poll API still works on an extended CQ. */
	ibv_wr_start(x);
	x->wr_id = 30;
	x->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_write(x, md->rkey, (uintptr_t)dst);
	ibv_wr_set_sge(x, ms->lkey, (uintptr_t)src, 8);
	if (ibv_wr_complete(x))
		fail("wr_complete");
	struct ibv_wc wc = poll1(ibv_cq_ex_to_cq(cq));
	if (wc.wr_id != 30 || wc.status)
		fail("ibv_poll_cq on an extended CQ");
	ok("ibv_poll_cq works on an extended CQ");
	struct ibv_cq_init_attr_ex bad = { .cqe = 4, .wc_flags = IBV_WC_EX_WITH_FLOW_TAG };
	errno = 0;
	if (ibv_create_cq_ex(ctx, &bad) || errno != EOPNOTSUPP)
		fail("create_cq_ex with FLOW_TAG accepted");
	ok("create_cq_ex with an unsupported wc flag: EOPNOTSUPP");
}

/* One attack from a fresh connected pair (a -> b, b's QP in `bpd`): an RDMA op must fail with
 * REM_ACCESS_ERR. */
static void attack(struct ibv_pd *bpd, enum ibv_wr_opcode op, uint64_t raddr, uint32_t rkey, uint32_t len,
		   const char *what)
{
	struct ibv_cq *cq = cq_new(16);
	struct ibv_qp *a = qp_new(cq, IBV_QPT_RC, NULL, 0);
	struct ibv_pd *keep = pd;
	pd = bpd;
	struct ibv_qp *b = qp_new(cq, IBV_QPT_RC, NULL, 0);
	pd = keep;
	rc_connect(a, b->qp_num, 12, 7, 14, 7);
	rc_connect(b, a->qp_num, 12, 7, 14, 7);
	static uint8_t local[8192];
	static struct ibv_mr *lmr;
	if (!lmr)
		lmr = reg(local, sizeof local, ALL_ACCESS);
	memset(local, 0x11, sizeof local);
	if (post(a, 1, op, local, len, lmr->lkey, raddr, rkey, 0, 0, IBV_SEND_SIGNALED))
		fail("post %s", what);
	struct ibv_wc wc = poll1(cq);
	if (wc.status != IBV_WC_REM_ACCESS_ERR)
		fail("%s: %s, expected remote access error", what, ibv_wc_status_str(wc.status));
	for (unsigned i = 0; i < sizeof local; i++)
		if (local[i] != 0x11)
			fail("%s: the requester's buffer changed (data leaked back)", what);
	ibv_destroy_qp(a);
	ibv_destroy_qp(b);
	ibv_destroy_cq(cq);
}

/* Every way to reach a victim MR without a valid rkey on a connected QP fails, and the victim's
 * bytes stay as they were. */
static void case_isolation(void)
{
	size_t n = 64 << 10;
	uint8_t *v = aligned_alloc(4096, n);
	memset(v, 0x5A, n);
	struct ibv_mr *vm = reg(v, n, ALL_ACCESS);
	uint64_t va = (uintptr_t)v;
	srand48(12345);
	for (int i = 0; i < 200; i++) {
		uint32_t guess = (uint32_t)mrand48();
		if (guess == vm->rkey)
			continue;
		attack(pd, i % 3 == 0 ? IBV_WR_RDMA_READ : i % 3 == 1 ? IBV_WR_RDMA_WRITE : IBV_WR_ATOMIC_FETCH_AND_ADD,
		       va + 8 * (i % 64), guess, i % 3 == 2 ? 8 : 64, "guessed rkey");
	}
	ok("200 guessed rkeys (READ, WRITE, FETCH_AND_ADD): all remote access errors");
	/* The rkey of a deregistered MR. */
	uint8_t *gone = aligned_alloc(4096, 4096);
	memset(gone, 0x33, 4096);
	struct ibv_mr *gm = reg(gone, 4096, ALL_ACCESS);
	uint32_t old_rkey = gm->rkey;
	if (ibv_dereg_mr(gm))
		fail("dereg");
	attack(pd, IBV_WR_RDMA_WRITE, (uintptr_t)gone, old_rkey, 64, "write with a deregistered MR's rkey");
	attack(pd, IBV_WR_RDMA_READ, (uintptr_t)gone, old_rkey, 64, "read with a deregistered MR's rkey");
	for (int i = 0; i < 4096; i++)
		if (gone[i] != 0x33)
			fail("a deregistered buffer changed");
	ok("after ibv_dereg_mr its rkey reaches nothing; the buffer keeps its bytes");
	/* Past the end, and an MR without the remote access asked for. */
	attack(pd, IBV_WR_RDMA_WRITE, va + n - 8, vm->rkey, 64, "write past the MR's end");
	attack(pd, IBV_WR_RDMA_READ, va - 64, vm->rkey, 64, "read before the MR's start");
	uint8_t *ro = aligned_alloc(4096, 4096);
	memset(ro, 0x44, 4096);
	struct ibv_mr *rom = reg(ro, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
	attack(pd, IBV_WR_RDMA_WRITE, (uintptr_t)ro, rom->rkey, 64, "write to an MR without REMOTE_WRITE");
	attack(pd, IBV_WR_ATOMIC_CMP_AND_SWP, (uintptr_t)ro, rom->rkey, 8, "atomic on an MR without REMOTE_ATOMIC");
	for (int i = 0; i < 4096; i++)
		if (ro[i] != 0x44)
			fail("a read-only MR changed");
	ok("past the end, before the start, missing access flags: remote access errors, no byte changed");
	/* The right rkey, but the responder QP is in another PD. */
	struct ibv_pd *other = ibv_alloc_pd(ctx);
	if (!other)
		fail("alloc_pd");
	attack(other, IBV_WR_RDMA_WRITE, va, vm->rkey, 64, "write through a QP of another PD");
	attack(other, IBV_WR_RDMA_READ, va, vm->rkey, 64, "read through a QP of another PD");
	ok("the right rkey through a responder QP of another PD: remote access errors");
	for (size_t i = 0; i < n; i++)
		if (v[i] != 0x5A)
			fail("victim byte %zu changed", i);
	ok("the victim's %zu bytes are unchanged", n);
}

/* Registration keeps every byte: pages the app wrote keep them, pages it never touched read
 * as zeros (the driver skips copying those), also after a region page was used and freed. */
static void case_reg_contents(void)
{
	size_t pages = 256, n = pages * 4096;
	for (int round = 0; round < 3; round++) {
		uint8_t *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (p == MAP_FAILED)
			fail("mmap");
		for (size_t i = 0; i < pages; i += 3)
			memset(p + i * 4096, (int)(i + round) | 1, 4096);
		/* Some pages only read: mapped to the zero page, present but zero. */
		volatile uint8_t sink = 0;
		for (size_t i = 1; i < pages; i += 7)
			sink += p[i * 4096];
		(void)sink;
		struct ibv_mr *mr = reg(p, n, ALL_ACCESS);
		for (size_t i = 0; i < pages; i++) {
			uint8_t want = i % 3 == 0 ? (uint8_t)((i + round) | 1) : 0;
			for (size_t j = 0; j < 4096; j += 511)
				if (p[i * 4096 + j] != want)
					fail("round %d page %zu byte %zu: %x, expected %x", round, i, j, p[i * 4096 + j], want);
		}
		/* Leave bytes behind in the region pages, so the next round's reuse is checked. */
		memset(p, 0xEE, n);
		if (ibv_dereg_mr(mr))
			fail("dereg");
		munmap(p, n);
	}
	ok("written pages keep their bytes, untouched and read-only pages read zero, over 3 reuse rounds");
	/* Every page written: one run of 1 MiB, which the driver writes into the region through
	 * the file (pwrite) rather than the mapping; over reused region pages holding 0xEE. */
	for (int round = 0; round < 3; round++) {
		uint8_t *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (p == MAP_FAILED)
			fail("mmap");
		for (size_t i = 0; i < n; i++)
			p[i] = (uint8_t)(i * 7 + i / 4096 + round);
		struct ibv_mr *mr = reg(p, n, ALL_ACCESS);
		for (size_t i = 0; i < n; i++)
			if (p[i] != (uint8_t)(i * 7 + i / 4096 + round))
				fail("dense round %d byte %zu: %x", round, i, p[i]);
		memset(p, 0xEE, n);
		if (ibv_dereg_mr(mr))
			fail("dereg");
		munmap(p, n);
	}
	ok("a written 1 MiB run keeps every byte, over 3 reuse rounds");
}

/* Registration changes no byte another thread writes meanwhile. The driver moves a buffer's
 * pages onto the vRNIC's region when it is registered (and back when it is given up); a page
 * the buffer shares with other data (its last page here, where a counter lives) is written by
 * another thread all the while. Every increment must survive: none may be lost between the
 * driver's copy of the page and its remap. The same for deregistration's move back. */
static _Atomic(volatile uint64_t *) nb_target;
static _Atomic uint64_t nb_done;
static _Atomic int nb_phase, nb_ack, nb_stop;

static void *nb_writer(void *arg)
{
	(void)arg;
	while (!atomic_load(&nb_stop)) {
		int phase = atomic_load(&nb_phase);
		if (phase == atomic_load(&nb_ack)) {
			sched_yield();
			continue;
		}
		volatile uint64_t *t = atomic_load(&nb_target);
		uint64_t n = 0;
		atomic_store(&nb_ack, -phase);
		while (atomic_load(&nb_phase) == phase) {
			*t = *t + 1;
			n++;
		}
		atomic_store(&nb_done, n);
		atomic_store(&nb_ack, atomic_load(&nb_phase));
	}
	return NULL;
}

static void case_reg_neighbours(void)
{
	pthread_t w;
	pthread_create(&w, NULL, nb_writer, NULL);
	int phase = 0, lost_reg = 0, lost_dereg = 0;
	for (int i = 0; i < 300; i++) {
		uint8_t *p = mmap(NULL, 3 * 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (p == MAP_FAILED)
			fail("mmap");
		memset(p, 0x5C, 3 * 4096);
		volatile uint64_t *ctr = (volatile uint64_t *)(p + 2 * 4096 + 2048);
		*ctr = 0;
		/* The buffer: 2.25 pages; its last page holds the counter too. */
		atomic_store(&nb_target, ctr);
		atomic_store(&nb_phase, ++phase);
		while (atomic_load(&nb_ack) != -phase)
			;
		struct ibv_mr *mr = reg(p, 2 * 4096 + 1024, ALL_ACCESS);
		atomic_store(&nb_phase, ++phase);
		while (atomic_load(&nb_ack) != phase)
			;
		if (*ctr != atomic_load(&nb_done))
			lost_reg++;
		for (size_t j = 0; j < 2 * 4096 + 1024; j += 97)
			if (p[j] != 0x5C)
				fail("round %d: registered byte %zu changed", i, j);
		/* Deregistration, then another registration that needs the pages back: the driver
		 * moves parked pages off the region when the vRNIC runs short, and at the latest
		 * when the pages are registered again elsewhere. */
		*ctr = 0;
		atomic_store(&nb_phase, ++phase);
		while (atomic_load(&nb_ack) != -phase)
			;
		if (ibv_dereg_mr(mr))
			fail("dereg");
		atomic_store(&nb_phase, ++phase);
		while (atomic_load(&nb_ack) != phase)
			;
		if (*ctr != atomic_load(&nb_done))
			lost_dereg++;
		munmap(p, 3 * 4096);
	}
	atomic_store(&nb_stop, 1);
	pthread_join(w, NULL);
	if (lost_reg || lost_dereg)
		fail("writes of another thread to a page the buffer shares were lost: %d of 300 registrations, %d of 300 deregistrations",
		     lost_reg, lost_dereg);
	ok("300 registrations and deregistrations lose no write another thread makes to the pages they share");
}

/* Every create_* and modify_* attribute past what ibv_query_device (and ibv_query_port)
 * report is refused with EINVAL, and exactly the limit is accepted. */
#define EXPECT_NULL_EINVAL(call, what)                                   \
	do {                                                             \
		errno = 0;                                               \
		void *p_ = (void *)(call);                               \
		if (p_ || errno != EINVAL)                               \
			fail("%s: %s (errno %d)", what, p_ ? "accepted" : "wrong errno", errno); \
		ok("%s: EINVAL", what);                                  \
	} while (0)
#define EXPECT_RC_EINVAL(call, what)                                     \
	do {                                                             \
		int rc_ = (call);                                        \
		if (rc_ != EINVAL)                                       \
			fail("%s: returned %d, expected EINVAL", what, rc_); \
		ok("%s: EINVAL", what);                                  \
	} while (0)

static void case_dev_limits(void)
{
	struct ibv_device_attr da;
	if (ibv_query_device(ctx, &da))
		fail("query_device");
	/* CQs: depth and completion vector. */
	EXPECT_NULL_EINVAL(ibv_create_cq(ctx, da.max_cqe + 1, NULL, NULL, 0), "create_cq cqe max_cqe+1");
	EXPECT_NULL_EINVAL(ibv_create_cq(ctx, 16, NULL, NULL, ctx->num_comp_vectors),
			   "create_cq comp_vector num_comp_vectors");
	EXPECT_NULL_EINVAL(ibv_create_cq(ctx, 16, NULL, NULL, -1), "create_cq comp_vector -1");
	struct ibv_cq_init_attr_ex ce = { .cqe = da.max_cqe + 1, .wc_flags = IBV_WC_STANDARD_FLAGS };
	EXPECT_NULL_EINVAL(ibv_create_cq_ex(ctx, &ce), "create_cq_ex cqe max_cqe+1");
	ce.cqe = 16;
	ce.comp_vector = ctx->num_comp_vectors;
	EXPECT_NULL_EINVAL(ibv_create_cq_ex(ctx, &ce), "create_cq_ex comp_vector num_comp_vectors");
	struct ibv_cq *big = ibv_create_cq(ctx, da.max_cqe, NULL, NULL, ctx->num_comp_vectors - 1);
	if (!big || big->cqe < da.max_cqe)
		fail("create_cq at max_cqe with the last comp_vector");
	ibv_destroy_cq(big);
	ok("create_cq at max_cqe (%d) and comp_vector %d: accepted", da.max_cqe, ctx->num_comp_vectors - 1);

	/* QPs: every capability, through create_qp and create_qp_ex. */
	struct ibv_cq *cq = cq_new(16);
	struct ibv_qp_init_attr base = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
					 .cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1,
						  .max_recv_sge = 1 } };
	struct { const char *what; struct ibv_qp_init_attr ia; } over[] = {
		{ "create_qp max_send_wr max_qp_wr+1", base },
		{ "create_qp max_recv_wr max_qp_wr+1", base },
		{ "create_qp max_send_sge max_sge+1", base },
		{ "create_qp max_recv_sge max_sge+1", base },
		{ "create_qp max_inline_data over the device's", base },
	};
	over[0].ia.cap.max_send_wr = da.max_qp_wr + 1;
	over[1].ia.cap.max_recv_wr = da.max_qp_wr + 1;
	over[2].ia.cap.max_send_sge = da.max_sge + 1;
	over[3].ia.cap.max_recv_sge = da.max_sge + 1;
	over[4].ia.cap.max_inline_data = 1 << 20;
	for (unsigned i = 0; i < sizeof over / sizeof over[0]; i++) {
		EXPECT_NULL_EINVAL(ibv_create_qp(pd, &over[i].ia), over[i].what);
		struct ibv_qp_init_attr_ex ix = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
						  .cap = over[i].ia.cap, .comp_mask = IBV_QP_INIT_ATTR_PD, .pd = pd };
		char what[128];
		snprintf(what, sizeof what, "%s (create_qp_ex)", over[i].what);
		EXPECT_NULL_EINVAL(ibv_create_qp_ex(ctx, &ix), what);
	}
	struct ibv_qp_init_attr at = base;
	at.cap = (struct ibv_qp_cap){ .max_send_wr = da.max_qp_wr, .max_recv_wr = da.max_qp_wr,
				      .max_send_sge = da.max_sge, .max_recv_sge = da.max_sge };
	struct ibv_qp *qp = ibv_create_qp(pd, &at);
	if (!qp)
		fail("create_qp at max_qp_wr and max_sge");
	ibv_destroy_qp(qp);
	ok("create_qp at max_qp_wr (%d) and max_sge (%d): accepted", da.max_qp_wr, da.max_sge);

	/* modify_qp: read/atomic depths against max_qp_init_rd_atom / max_qp_rd_atom, the port
	 * against phys_port_cnt, P_Key index against pkey_tbl_len, the MTU against the port's. */
	qp = qp_new(cq, IBV_QPT_RC, NULL, 0);
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = da.phys_port_cnt + 1,
				 .qp_access_flags = IBV_ACCESS_REMOTE_WRITE };
	EXPECT_RC_EINVAL(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
						      IBV_QP_ACCESS_FLAGS),
			 "modify_qp port phys_port_cnt+1");
	a.port_num = 1;
	a.pkey_index = da.max_pkeys;
	EXPECT_RC_EINVAL(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
						      IBV_QP_ACCESS_FLAGS),
			 "modify_qp pkey_index max_pkeys");
	a.pkey_index = 0;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
		fail("modify INIT");
	a = (struct ibv_qp_attr){ .qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_4096, .dest_qp_num = qp->qp_num,
				  .max_dest_rd_atomic = da.max_qp_rd_atom + 1, .min_rnr_timer = 12,
				  .ah_attr = { .dlid = lid, .port_num = 1 } };
	int rtr = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
		  IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
	EXPECT_RC_EINVAL(ibv_modify_qp(qp, &a, rtr), "modify_qp max_dest_rd_atomic max_qp_rd_atom+1");
	a.max_dest_rd_atomic = da.max_qp_rd_atom;
	a.path_mtu = IBV_MTU_4096 + 1;
	EXPECT_RC_EINVAL(ibv_modify_qp(qp, &a, rtr), "modify_qp path_mtu over the port's");
	a.path_mtu = IBV_MTU_4096;
	a.ah_attr.is_global = 1;
	a.ah_attr.grh.sgid_index = 1;
	a.ah_attr.grh.dgid = gid;
	EXPECT_RC_EINVAL(ibv_modify_qp(qp, &a, rtr), "modify_qp sgid_index gid_tbl_len");
	a.ah_attr.is_global = 0;
	if (ibv_modify_qp(qp, &a, rtr))
		fail("modify RTR at max_qp_rd_atom");
	a = (struct ibv_qp_attr){ .qp_state = IBV_QPS_RTS, .timeout = 14, .retry_cnt = 7, .rnr_retry = 7,
				  .max_rd_atomic = da.max_qp_init_rd_atom + 1 };
	int rts = IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
		  IBV_QP_MAX_QP_RD_ATOMIC;
	EXPECT_RC_EINVAL(ibv_modify_qp(qp, &a, rts), "modify_qp max_rd_atomic max_qp_init_rd_atom+1");
	a.max_rd_atomic = da.max_qp_init_rd_atom;
	if (ibv_modify_qp(qp, &a, rts))
		fail("modify RTS at max_qp_init_rd_atom");
	ok("modify_qp at max_qp_rd_atom (%d) and max_qp_init_rd_atom (%d): accepted", da.max_qp_rd_atom,
	   da.max_qp_init_rd_atom);

	/* SRQs: depth, SGEs, limit; through create_srq and create_srq_ex. */
	struct ibv_srq_init_attr si = { .attr = { .max_wr = da.max_srq_wr + 1, .max_sge = 1 } };
	EXPECT_NULL_EINVAL(ibv_create_srq(pd, &si), "create_srq max_wr max_srq_wr+1");
	si.attr = (struct ibv_srq_attr){ .max_wr = 4, .max_sge = da.max_srq_sge + 1 };
	EXPECT_NULL_EINVAL(ibv_create_srq(pd, &si), "create_srq max_sge max_srq_sge+1");
	si.attr = (struct ibv_srq_attr){ .max_wr = 4, .max_sge = 1, .srq_limit = 5 };
	EXPECT_NULL_EINVAL(ibv_create_srq(pd, &si), "create_srq srq_limit over max_wr");
	struct ibv_srq_init_attr_ex sx = { .attr = { .max_wr = da.max_srq_wr + 1, .max_sge = 1 },
					   .comp_mask = IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_PD,
					   .srq_type = IBV_SRQT_BASIC, .pd = pd };
	EXPECT_NULL_EINVAL(ibv_create_srq_ex(ctx, &sx), "create_srq_ex max_wr max_srq_wr+1");
	sx.attr = (struct ibv_srq_attr){ .max_wr = 4, .max_sge = da.max_srq_sge + 1 };
	EXPECT_NULL_EINVAL(ibv_create_srq_ex(ctx, &sx), "create_srq_ex max_sge max_srq_sge+1");
	si.attr = (struct ibv_srq_attr){ .max_wr = da.max_srq_wr, .max_sge = da.max_srq_sge };
	struct ibv_srq *srq = ibv_create_srq(pd, &si);
	if (!srq)
		fail("create_srq at max_srq_wr and max_srq_sge");
	ibv_destroy_srq(srq);
	ok("create_srq at max_srq_wr (%d) and max_srq_sge (%d): accepted", da.max_srq_wr, da.max_srq_sge);
	si.attr = (struct ibv_srq_attr){ .max_wr = 8, .max_sge = 1 };
	srq = ibv_create_srq(pd, &si);
	if (!srq)
		fail("create_srq");
	struct ibv_srq_attr sa = { .srq_limit = si.attr.max_wr + 1 };
	EXPECT_RC_EINVAL(ibv_modify_srq(srq, &sa, IBV_SRQ_LIMIT), "modify_srq srq_limit over max_wr");

	/* Address handles: port and GID index. */
	struct ibv_ah_attr ah = { .dlid = lid, .port_num = da.phys_port_cnt + 1 };
	EXPECT_NULL_EINVAL(ibv_create_ah(pd, &ah), "create_ah port phys_port_cnt+1");
	ah = (struct ibv_ah_attr){ .dlid = lid, .port_num = 1, .is_global = 1,
				   .grh = { .dgid = gid, .sgid_index = 1, .hop_limit = 1 } };
	EXPECT_NULL_EINVAL(ibv_create_ah(pd, &ah), "create_ah sgid_index gid_tbl_len");
}

/* A full queue accepts no more: receives past max_recv_wr (plain and extended QPs), receives
 * past an SRQ's max_wr and sends past max_send_wr fail with ENOMEM, bad_wr names the first WR
 * not posted, and none of the excess is posted (the receiver consumes exactly the receives that
 * fit; one more send finds no receive: RNR). Depths that are not powers of two, so a ring
 * rounded up cannot hide the limit. */
#define QF_DEPTH 10
static struct ibv_recv_wr qf_wrs[QF_DEPTH + 4];
static struct ibv_sge qf_sge;

/* Posts `n` receives as one chain starting at wr_id `first`; returns the error and bad_wr. */
static int qf_post(struct ibv_qp *qp, struct ibv_srq *srq, uint64_t first, int n, struct ibv_recv_wr **bad)
{
	for (int i = 0; i < n; i++)
		qf_wrs[i] = (struct ibv_recv_wr){ .wr_id = first + i, .sg_list = &qf_sge, .num_sge = 1,
						  .next = i + 1 < n ? &qf_wrs[i + 1] : NULL };
	*bad = NULL;
	return srq ? ibv_post_srq_recv(srq, qf_wrs, bad) : ibv_post_recv(qp, qf_wrs, bad);
}

/* Receiver `rx` (or its SRQ) holds `cap` receives; `tx` sends cap messages, then one more. */
static void qf_check(const char *what, struct ibv_qp *rx, struct ibv_srq *srq, uint32_t cap,
		     struct ibv_cq *rcq, struct ibv_cq *scq, struct ibv_qp *tx, struct ibv_mr *mr, void *buf)
{
	struct ibv_recv_wr *bad;
	int rc = qf_post(rx, srq, 1, cap - 2, &bad);
	if (rc)
		fail("%s: posting %u receives: %d", what, cap - 2, rc);
	rc = qf_post(rx, srq, cap - 1, 5, &bad);
	if (rc != ENOMEM || bad != &qf_wrs[2])
		fail("%s: a chain of 5 with room for 2: returned %d, bad_wr %s", what, rc,
		     bad == &qf_wrs[2] ? "the third" : "wrong");
	ok("%s: past %u receives ENOMEM, bad_wr the first not posted", what, cap);
	rc = qf_post(rx, srq, 100, 1, &bad);
	if (rc != ENOMEM || bad != &qf_wrs[0])
		fail("%s: one more on a full queue: returned %d", what, rc);
	for (uint32_t i = 0; i < cap; i++)
		if (post(tx, 1000 + i, IBV_WR_SEND, buf, 8, mr->lkey, 0, 0, 0, 0, IBV_SEND_SIGNALED))
			fail("%s: post_send", what);
	for (uint32_t i = 0; i < cap; i++) {
		struct ibv_wc wc = poll1(rcq);
		if (wc.status != IBV_WC_SUCCESS || wc.wr_id != 1 + i)
			fail("%s: receive %u: wr %lu %s", what, i, (unsigned long)wc.wr_id,
			     ibv_wc_status_str(wc.status));
		wc = poll1(scq);
		if (wc.status != IBV_WC_SUCCESS)
			fail("%s: send %u: %s", what, i, ibv_wc_status_str(wc.status));
	}
	if (post(tx, 2000, IBV_WR_SEND, buf, 8, mr->lkey, 0, 0, 0, 0, IBV_SEND_SIGNALED))
		fail("%s: post_send", what);
	expect(scq, 2000, IBV_WC_RNR_RETRY_EXC_ERR, "one more send finds no receive");
	ok("%s: exactly the %u receives that fit were posted", what, cap);
}

static void case_queue_full(void)
{
	static uint8_t buf[4096];
	struct ibv_mr *mr = reg(buf, sizeof buf, IBV_ACCESS_LOCAL_WRITE);
	qf_sge = (struct ibv_sge){ .addr = (uintptr_t)buf, .length = 64, .lkey = mr->lkey };
	struct ibv_qp_cap cap = { .max_send_wr = QF_DEPTH, .max_recv_wr = QF_DEPTH, .max_send_sge = 1,
				  .max_recv_sge = 1 };
	for (int ex = 0; ex < 2; ex++) {
		struct ibv_cq *rcq = cq_new(64), *scq = cq_new(64);
		struct ibv_qp_init_attr ia = { .send_cq = rcq, .recv_cq = rcq, .qp_type = IBV_QPT_RC, .cap = cap };
		struct ibv_qp *rx;
		if (ex) {
			struct ibv_qp_init_attr_ex ix = { .send_cq = rcq, .recv_cq = rcq, .qp_type = IBV_QPT_RC,
							  .cap = cap, .pd = pd,
							  .comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
							  .send_ops_flags = IBV_QP_EX_WITH_SEND };
			rx = ibv_create_qp_ex(ctx, &ix);
			ia.cap = ix.cap;
		} else {
			rx = ibv_create_qp(pd, &ia);
		}
		if (!rx)
			fail("create_qp");
		struct ibv_qp_init_attr ta = { .send_cq = scq, .recv_cq = scq, .qp_type = IBV_QPT_RC, .cap = cap };
		struct ibv_qp *tx = ibv_create_qp(pd, &ta);
		if (!tx)
			fail("create_qp");
		rc_connect(rx, tx->qp_num, 1, 1, 14, 7);
		rc_connect(tx, rx->qp_num, 1, 1, 14, 7);
		qf_check(ex ? "extended QP" : "QP", rx, NULL, ia.cap.max_recv_wr, rcq, scq, tx, mr, buf);
	}
	/* An SRQ. */
	struct ibv_srq_init_attr si = { .attr = { .max_wr = QF_DEPTH, .max_sge = 1 } };
	struct ibv_srq *srq = ibv_create_srq(pd, &si);
	if (!srq)
		fail("create_srq");
	struct ibv_cq *rcq = cq_new(64), *scq = cq_new(64);
	struct ibv_qp_init_attr ia = { .send_cq = rcq, .recv_cq = rcq, .srq = srq, .qp_type = IBV_QPT_RC, .cap = cap };
	struct ibv_qp *rx = ibv_create_qp(pd, &ia);
	struct ibv_qp_init_attr ta = { .send_cq = scq, .recv_cq = scq, .qp_type = IBV_QPT_RC, .cap = cap };
	struct ibv_qp *tx = ibv_create_qp(pd, &ta);
	if (!rx || !tx)
		fail("create_qp");
	rc_connect(rx, tx->qp_num, 1, 1, 14, 7);
	rc_connect(tx, rx->qp_num, 1, 1, 14, 7);
	qf_check("SRQ", rx, srq, si.attr.max_wr, rcq, scq, tx, mr, buf);

	/* Sends: the first waits for a receive (RNR, retried forever), the others queue behind it
	 * until max_send_wr are outstanding; one more is ENOMEM. */
	struct ibv_cq *c1 = cq_new(64);
	struct ibv_qp_init_attr sa = { .send_cq = c1, .recv_cq = c1, .qp_type = IBV_QPT_RC, .cap = cap };
	struct ibv_qp *a = ibv_create_qp(pd, &sa), *b = ibv_create_qp(pd, &sa);
	if (!a || !b)
		fail("create_qp");
	rc_connect(a, b->qp_num, 1, 7, 14, 7);
	rc_connect(b, a->qp_num, 1, 7, 14, 7);
	for (uint32_t i = 0; i < sa.cap.max_send_wr; i++)
		if (post(a, 3000 + i, IBV_WR_SEND, buf, 8, mr->lkey, 0, 0, 0, 0, IBV_SEND_SIGNALED))
			fail("post_send %u of %u", i, sa.cap.max_send_wr);
	struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = 8, .lkey = mr->lkey };
	struct ibv_send_wr w = { .wr_id = 4000, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND }, *sbad = NULL;
	int rc = ibv_post_send(a, &w, &sbad);
	if (rc != ENOMEM || sbad != &w)
		fail("send past max_send_wr (%u): returned %d", sa.cap.max_send_wr, rc);
	ok("send past max_send_wr (%u): ENOMEM, bad_wr set", sa.cap.max_send_wr);
}

/* fork(): registered memory is region pages mapped MAP_SHARED over the app's buffer, so a
 * fork never moves the parent's pages (no copy on write to miss): ibv_is_fork_initialized
 * answers IBV_FORK_UNNEEDED, ibv_fork_init succeeds and changes nothing, and after a fork the
 * parent's registrations keep working both ways: bytes the parent writes after the fork are
 * what a send carries, and bytes an RDMA WRITE puts there are what the parent reads. The child
 * shares the registered pages (documented): what it writes there, the parent sees. */
static void case_fork(void)
{
	if (ibv_is_fork_initialized() != IBV_FORK_UNNEEDED)
		fail("ibv_is_fork_initialized: %d, expected IBV_FORK_UNNEEDED", ibv_is_fork_initialized());
	ok("ibv_is_fork_initialized: IBV_FORK_UNNEEDED");
	if (ibv_fork_init())
		fail("ibv_fork_init");
	if (ibv_is_fork_initialized() != IBV_FORK_UNNEEDED)
		fail("after ibv_fork_init: %d", ibv_is_fork_initialized());
	ok("ibv_fork_init: 0, still IBV_FORK_UNNEEDED");
	enum { N = 3 * 4096 + 100 };
	uint8_t *a = malloc(N), *b = malloc(N), *c = malloc(4096);
	memset(a, 1, N);
	memset(b, 2, N);
	memset(c, 3, 4096);
	struct ibv_mr *ma = reg(a, N, ALL_ACCESS), *mb = reg(b, N, ALL_ACCESS);
	reg(c, 4096, ALL_ACCESS);
	struct ibv_cq *cq = cq_new(16);
	struct ibv_qp *qa = qp_new(cq, IBV_QPT_RC, NULL, 0), *qb = qp_new(cq, IBV_QPT_RC, NULL, 0);
	rc_connect(qa, qb->qp_num, 1, 7, 14, 7);
	rc_connect(qb, qa->qp_num, 1, 7, 14, 7);
	fflush(stdout);
	pid_t pid = fork();
	if (pid < 0)
		fail("fork");
	if (pid == 0) {
		/* The child sees the registered bytes and shares the pages. */
		int bad = a[0] != 1 || a[N - 1] != 1;
		memset(c, 0x5a, 4096);
		exit(bad);
	}
	int st;
	if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st))
		fail("child: status %#x", st);
	if (c[0] != 0x5a || c[4095] != 0x5a)
		fail("the child's write to a registered page is not shared");
	ok("the child shares the registered pages");
	for (int i = 0; i < N; i++)
		a[i] = (uint8_t)(i * 13 + 7);
	recv_on(qb, 10, b, N, mb->lkey);
	if (post(qa, 11, IBV_WR_SEND, a, N, ma->lkey, 0, 0, 0, 0, IBV_SEND_SIGNALED))
		fail("post_send");
	struct ibv_wc w1 = poll1(cq), w2 = poll1(cq);
	if (w1.status || w2.status)
		fail("send after fork: %s / %s", ibv_wc_status_str(w1.status), ibv_wc_status_str(w2.status));
	for (int i = 0; i < N; i++)
		if (b[i] != (uint8_t)(i * 13 + 7))
			fail("after fork, byte %d the send carried is %#x: not what the parent wrote", i, b[i]);
	ok("after fork, a send carries what the parent wrote after the fork");
	for (int i = 0; i < N; i++)
		b[i] = (uint8_t)(i * 5 + 1);
	if (post(qb, 12, IBV_WR_RDMA_WRITE, b, N, mb->lkey, (uintptr_t)a, ma->rkey, 0, 0, IBV_SEND_SIGNALED))
		fail("post write");
	expect(cq, 12, IBV_WC_SUCCESS, "RDMA WRITE into the parent's buffer after fork");
	for (int i = 0; i < N; i++)
		if (a[i] != (uint8_t)(i * 5 + 1))
			fail("after fork, byte %d an RDMA WRITE put in the parent's buffer reads %#x", i, a[i]);
	ok("after fork, the parent reads what an RDMA WRITE put in its buffer");
}

/* Event mode under stress: two threads post signaled RDMA WRITEs, each on its own QP, while
 * a third arms the shared send CQ, waits on its completion channel, gets and acks each event
 * and polls. 100000 completions: every one arrives, once, in each QP's order, and no wait is
 * left hanging (each is bounded). */
#define ES_TOTAL 100000
#define ES_DEPTH 64
static struct {
	struct ibv_qp *qp;
	struct ibv_mr *mr;
	uint8_t *buf;
	uint64_t raddr;
	uint32_t rkey;
	volatile uint64_t done; /* completions the waiter saw (written by it only) */
	uint64_t posted;
} es[2];
static volatile int es_failed;
static volatile uint64_t es_total;

/* Bounds the blocking waits: no progress for 10 s fails the case. */
static void *es_watchdog(void *arg)
{
	(void)arg;
	uint64_t last = 0;
	double since = now();
	while (__atomic_load_n(&es_total, __ATOMIC_ACQUIRE) < ES_TOTAL) {
		usleep(100000);
		uint64_t t = __atomic_load_n(&es_total, __ATOMIC_ACQUIRE);
		if (t != last) {
			last = t;
			since = now();
		} else if (now() - since > 10) {
			printf("FAIL a wait left hanging: no completion in 10 s with %lu of %d done\n",
			       (unsigned long)t, ES_TOTAL);
			fflush(stdout);
			_exit(1);
		}
	}
	return NULL;
}

static void *es_poster(void *arg)
{
	int k = (int)(intptr_t)arg;
	double deadline = now() + 120;
	while (es[k].posted < ES_TOTAL / 2 && !es_failed) {
		if (es[k].posted - __atomic_load_n(&es[k].done, __ATOMIC_ACQUIRE) >= ES_DEPTH) {
			if (now() > deadline) {
				es_failed = 1;
				break;
			}
			sched_yield();
			continue;
		}
		if (post(es[k].qp, (uint64_t)k << 32 | es[k].posted, IBV_WR_RDMA_WRITE, es[k].buf, 8,
			 es[k].mr->lkey, es[k].raddr, es[k].rkey, 0, 0, IBV_SEND_SIGNALED)) {
			es_failed = 2;
			break;
		}
		es[k].posted++;
	}
	return NULL;
}

static void case_event_stress(void)
{
	struct ibv_comp_channel *ch = ibv_create_comp_channel(ctx);
	if (!ch)
		fail("create_comp_channel");
	struct ibv_cq *cq = ibv_create_cq(ctx, 4 * ES_DEPTH, NULL, ch, 0);
	struct ibv_cq *other = cq_new(16);
	if (!cq)
		fail("create_cq");
	static uint8_t target[4096];
	struct ibv_mr *tmr = reg(target, sizeof target, ALL_ACCESS);
	for (int k = 0; k < 2; k++) {
		struct ibv_qp_init_attr ia = { .send_cq = cq, .recv_cq = other, .qp_type = IBV_QPT_RC,
					       .cap = { .max_send_wr = ES_DEPTH, .max_recv_wr = 1,
							.max_send_sge = 1, .max_recv_sge = 1 } };
		es[k].qp = ibv_create_qp(pd, &ia);
		struct ibv_qp *peer = qp_new(other, IBV_QPT_RC, NULL, 0);
		if (!es[k].qp)
			fail("create_qp");
		rc_connect(es[k].qp, peer->qp_num, 1, 7, 14, 7);
		rc_connect(peer, es[k].qp->qp_num, 1, 7, 14, 7);
		es[k].buf = malloc(64);
		es[k].mr = reg(es[k].buf, 64, IBV_ACCESS_LOCAL_WRITE);
		es[k].raddr = (uintptr_t)target + 64 * k;
		es[k].rkey = tmr->rkey;
	}
	pthread_t t[2], dog;
	if (pthread_create(&dog, NULL, es_watchdog, NULL))
		fail("pthread_create");
	for (int k = 0; k < 2; k++)
		if (pthread_create(&t[k], NULL, es_poster, (void *)(intptr_t)k))
			fail("pthread_create");
	uint64_t total = 0, events = 0, waits = 0;
	struct ibv_wc wc[32];
	while (total < ES_TOTAL && !es_failed) {
		int n = ibv_poll_cq(cq, 32, wc);
		if (n < 0)
			fail("poll_cq");
		if (n == 0) {
			if (ibv_req_notify_cq(cq, 0))
				fail("req_notify_cq");
			n = ibv_poll_cq(cq, 32, wc);
			if (n < 0)
				fail("poll_cq");
		}
		if (n == 0) {
			struct pollfd p = { .fd = ch->fd, .events = POLLIN };
			/* Every other wait blocks in ibv_get_cq_event itself (bounded by the watchdog). */
			if (waits++ % 2 == 0 && poll(&p, 1, 10000) != 1)
				fail("a wait left hanging: no event in 10 s with %lu of %d completions, posted %lu+%lu",
				     (unsigned long)total, ES_TOTAL, (unsigned long)es[0].posted,
				     (unsigned long)es[1].posted);
			struct ibv_cq *ev;
			void *ectx;
			if (ibv_get_cq_event(ch, &ev, &ectx) || ev != cq)
				fail("get_cq_event");
			ibv_ack_cq_events(cq, 1);
			events++;
			continue;
		}
		for (int i = 0; i < n; i++) {
			int k = (int)(wc[i].wr_id >> 32);
			uint64_t seq = wc[i].wr_id & 0xffffffffu;
			if (wc[i].status != IBV_WC_SUCCESS || (k != 0 && k != 1))
				fail("completion %lu: %s", (unsigned long)wc[i].wr_id, ibv_wc_status_str(wc[i].status));
			if (seq != es[k].done)
				fail("QP %d: completion %lu where %lu was due (lost or repeated)", k,
				     (unsigned long)seq, (unsigned long)es[k].done);
			__atomic_store_n(&es[k].done, seq + 1, __ATOMIC_RELEASE);
		}
		total += n;
		__atomic_store_n(&es_total, total, __ATOMIC_RELEASE);
	}
	for (int k = 0; k < 2; k++)
		pthread_join(t[k], NULL);
	pthread_join(dog, NULL);
	if (es_failed)
		fail("a posting thread failed (%d)", es_failed);
	struct ibv_wc extra;
	if (ibv_poll_cq(cq, 1, &extra) != 0)
		fail("an extra completion");
	ok("%d completions from two posting threads, each once and in order, %lu waits, %lu events",
	   ES_TOTAL, (unsigned long)waits, (unsigned long)events);
	for (int k = 0; k < 2; k++)
		ibv_destroy_qp(es[k].qp);
	if (ibv_destroy_cq(cq) || ibv_destroy_comp_channel(ch))
		fail("destroy the CQ and its channel");
	ok("no event left pending: the CQ and its channel destroyed");
}

/* Run on a daemon started with --max-qp 4 --max-cq 4 --max-mr 8 --max-srq 2 --region-gib 1. */
static void case_limits(void)
{
	struct ibv_device_attr da;
	if (ibv_query_device(ctx, &da) || da.max_qp != 4 || da.max_cq != 4 || da.max_mr != 8)
		fail("query_device: max_qp %d max_cq %d max_mr %d", da.max_qp, da.max_cq, da.max_mr);
	ok("query_device reports the daemon's limits (4 QPs, 4 CQs, 8 MRs)");
	struct ibv_cq *cqs[4];
	for (int i = 0; i < 4; i++)
		cqs[i] = cq_new(4);
	errno = 0;
	if (ibv_create_cq(ctx, 4, NULL, NULL, 0) || errno != ENOMEM)
		fail("a fifth CQ was not refused with ENOMEM");
	ok("CQ past the limit: ENOMEM");
	for (int i = 0; i < 4; i++)
		qp_new(cqs[i], IBV_QPT_RC, NULL, 0);
	struct ibv_qp_init_attr ia = { .send_cq = cqs[0], .recv_cq = cqs[0], .qp_type = IBV_QPT_RC,
				       .cap = { .max_send_wr = 1, .max_recv_wr = 1, .max_send_sge = 1,
						.max_recv_sge = 1 } };
	errno = 0;
	if (ibv_create_qp(pd, &ia) || errno != ENOMEM)
		fail("a fifth QP was not refused with ENOMEM");
	ok("QP past the limit: ENOMEM");
	static uint8_t small[8][4096];
	for (int i = 0; i < 8; i++)
		reg(small[i], 4096, IBV_ACCESS_LOCAL_WRITE);
	errno = 0;
	static uint8_t one_more[4096];
	if (ibv_reg_mr(pd, one_more, 4096, IBV_ACCESS_LOCAL_WRITE) || errno != ENOMEM)
		fail("a ninth MR was not refused with ENOMEM");
	ok("MR past the limit: ENOMEM");
	struct ibv_srq_init_attr si = { .attr = { .max_wr = 4, .max_sge = 1 } };
	if (!ibv_create_srq(pd, &si) || !ibv_create_srq(pd, &si))
		fail("two SRQs");
	errno = 0;
	if (ibv_create_srq(pd, &si) || errno != ENOMEM)
		fail("a third SRQ was not refused with ENOMEM");
	ok("SRQ past the limit: ENOMEM");
}

/* Run on a daemon started with --region-gib 1: registering more than the region fails. */
static void case_reg_limit(void)
{
	size_t big = (size_t)3 << 29; /* 1.5 GiB */
	uint8_t *p = mmap(NULL, big, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (p == MAP_FAILED)
		fail("mmap");
	errno = 0;
	if (ibv_reg_mr(pd, p, big, IBV_ACCESS_LOCAL_WRITE) || errno != ENOMEM)
		fail("registering 1.5 GiB in a 1 GiB region was not refused with ENOMEM");
	ok("registering more than the vRNIC's region: ENOMEM");
	struct ibv_mr *mr = ibv_reg_mr(pd, p, 1 << 20, IBV_ACCESS_LOCAL_WRITE);
	if (!mr)
		fail("a 1 MiB registration after the refused one");
	ok("the vRNIC still registers what fits");
}

/* Sends `n` 64-byte messages from `s` (signaled, on its own CQ `scq`), message i filled with
 * byte (seed + i), and waits for their send completions: by then the receiver's completions
 * are in its CQ (the daemon writes a message's receive completion before its send completion). */
static void send_n(struct ibv_qp *s, struct ibv_cq *scq, uint8_t *buf, struct ibv_mr *mr, int n, int seed)
{
	for (int i = 0; i < n; i++) {
		memset(buf + i * 64, (uint8_t)(seed + i), 64);
		if (post(s, 5000 + i, IBV_WR_SEND, buf + i * 64, 64, mr->lkey, 0, 0, 0, 0, IBV_SEND_SIGNALED))
			fail("post send %d", i);
	}
	for (int i = 0; i < n; i++) {
		struct ibv_wc wc = poll1(scq);
		if (wc.status || wc.wr_id != (uint64_t)(5000 + i))
			fail("send %d: %s wr %lu", i, ibv_wc_status_str(wc.status), (unsigned long)wc.wr_id);
	}
}

/* Polls `n` receive completions from `cq`: wr_ids first..first+n-1 in order, each 64 bytes
 * of byte (seed + k) in its slot of `dst` (slot = wr_id % slots). */
static void recv_n(struct ibv_cq *cq, int n, uint64_t first, uint8_t *dst, int slots, int seed, const char *what)
{
	for (int k = 0; k < n; k++) {
		struct ibv_wc wc = poll1(cq);
		uint64_t want = first + k;
		if (wc.status || wc.opcode != IBV_WC_RECV || wc.wr_id != want || wc.byte_len != 64)
			fail("%s: completion %d: %s wr %lu (want %lu) len %u", what, k, ibv_wc_status_str(wc.status),
			     (unsigned long)wc.wr_id, (unsigned long)want, wc.byte_len);
		uint8_t *p = dst + (want % slots) * 64;
		for (int j = 0; j < 64; j++)
			if (p[j] != (uint8_t)(seed + k))
				fail("%s: receive %lu byte %d is %#x, want %#x", what, (unsigned long)want, j, p[j],
				     (uint8_t)(seed + k));
	}
	struct ibv_wc extra;
	if (ibv_poll_cq(cq, 1, &extra) != 0)
		fail("%s: a completion more than expected (wr %lu)", what, (unsigned long)extra.wr_id);
}

static void post_recvs(struct ibv_qp *qp, struct ibv_srq *srq, uint64_t first, int n, uint8_t *dst, int slots,
		       struct ibv_mr *mr)
{
	for (int i = 0; i < n; i++) {
		uint64_t id = first + i;
		struct ibv_sge sge = { .addr = (uintptr_t)(dst + (id % slots) * 64), .length = 64, .lkey = mr->lkey };
		struct ibv_recv_wr wr = { .wr_id = id, .sg_list = &sge, .num_sge = 1 }, *bad;
		int r = srq ? ibv_post_srq_recv(srq, &wr, &bad) : ibv_post_recv(qp, &wr, &bad);
		if (r)
			fail("post receive %lu: %d", (unsigned long)id, r);
	}
}

/* ibv_resize_cq and SRQ resize (IBV_SRQ_MAX_WR): grow and shrink keeping what is pending,
 * refuse to shrink below it, the armed state and the events carried over. */
static void case_resize(void)
{
	struct ibv_device_attr da;
	if (ibv_query_device(ctx, &da))
		fail("query_device");
	if (!(da.device_cap_flags & IBV_DEVICE_SRQ_RESIZE))
		fail("IBV_DEVICE_SRQ_RESIZE not reported");
	ok("IBV_DEVICE_SRQ_RESIZE reported");
	enum { SLOTS = 128 };
	uint8_t *src = calloc(1, SLOTS * 64), *dst = calloc(1, SLOTS * 64);
	struct ibv_mr *ms = reg(src, SLOTS * 64, IBV_ACCESS_LOCAL_WRITE), *md = reg(dst, SLOTS * 64, IBV_ACCESS_LOCAL_WRITE);

	/* CQ: the receiver's CQ starts 4 deep, with a channel. */
	struct ibv_comp_channel *ch = ibv_create_comp_channel(ctx);
	if (!ch)
		fail("create_comp_channel");
	struct ibv_cq *scq = cq_new(256);
	struct ibv_cq *rcq = ibv_create_cq(ctx, 4, NULL, ch, 0);
	if (!rcq)
		fail("create_cq");
	if (rcq->cqe != 4)
		fail("create_cq(4) reports cqe %d", rcq->cqe);
	struct ibv_qp *a = qp_new(scq, IBV_QPT_RC, NULL, 0), *b = qp_new(rcq, IBV_QPT_RC, NULL, 0);
	rc_connect(a, b->qp_num, 12, 7, 14, 7);
	rc_connect(b, a->qp_num, 12, 7, 14, 7);
	post_recvs(b, NULL, 0, 3, dst, SLOTS, md);
	send_n(a, scq, src, ms, 3, 0x10);
	if (ibv_resize_cq(rcq, 2) != EINVAL)
		fail("resize_cq below the 3 completions waiting accepted");
	if (rcq->cqe != 4)
		fail("a refused resize changed cqe to %d", rcq->cqe);
	ok("resize_cq below the completions waiting: EINVAL, nothing changed");
	if (ibv_resize_cq(rcq, 3) || rcq->cqe < 3)
		fail("resize_cq to 3 (3 waiting)");
	if (ibv_resize_cq(rcq, 100) || rcq->cqe < 100)
		fail("resize_cq to 100: cqe %d", rcq->cqe);
	ok("resize_cq grows 4 -> %d with 3 completions waiting", rcq->cqe);
	recv_n(rcq, 3, 0, dst, SLOTS, 0x10, "after growing");
	ok("the 3 completions waiting survive the resize, in order, bytes exact");
	/* 60 completions now fit where 4 did (before, the 5th was an overrun). */
	post_recvs(b, NULL, 3, 60, dst, SLOTS, md);
	send_n(a, scq, src, ms, 60, 0x20);
	if (ibv_resize_cq(rcq, 59) != EINVAL)
		fail("resize_cq to 59 with 60 waiting accepted");
	ok("resize_cq to 59 with 60 waiting: EINVAL");
	if (ibv_resize_cq(rcq, 60) || rcq->cqe < 60 || rcq->cqe > 64)
		fail("resize_cq to 60 with 60 waiting: cqe %d", rcq->cqe);
	ok("resize_cq shrinks %d -> %d with 60 completions waiting", 128, rcq->cqe);
	recv_n(rcq, 60, 3, dst, SLOTS, 0x20, "after shrinking");
	ok("60 completions in order and exact after growing and shrinking");
	/* Armed before a resize: the next completion raises the event. */
	if (ibv_req_notify_cq(rcq, 0))
		fail("req_notify_cq");
	if (ibv_resize_cq(rcq, 8) || rcq->cqe != 8)
		fail("resize_cq to 8: cqe %d", rcq->cqe);
	post_recvs(b, NULL, 63, 1, dst, SLOTS, md);
	send_n(a, scq, src, ms, 1, 0x70);
	struct pollfd pf = { .fd = ch->fd, .events = POLLIN };
	if (poll(&pf, 1, POLL_SECONDS * 1000) != 1)
		fail("no completion event after the resize of an armed CQ");
	struct ibv_cq *ecq;
	void *ectx;
	if (ibv_get_cq_event(ch, &ecq, &ectx) || ecq != rcq)
		fail("get_cq_event");
	ibv_ack_cq_events(rcq, 1);
	recv_n(rcq, 1, 63, dst, SLOTS, 0x70, "after the event");
	ok("an armed CQ stays armed across a resize: one event, its completion exact");
	/* Overrun of the shrunk CQ: 9 completions into 8 slots put it in error. */
	post_recvs(b, NULL, 64, 9, dst, SLOTS, md);
	send_n(a, scq, src, ms, 9, 0x30);
	expect_event(IBV_EVENT_CQ_ERR, rcq, "9 completions into a CQ shrunk to 8");

	/* SRQ: 4 deep, full, grown to 16, drained by 10 SENDs, shrunk to 6 with 6 outstanding. */
	struct ibv_cq *cq = cq_new(256);
	struct ibv_srq_init_attr si = { .attr = { .max_wr = 4, .max_sge = 1 } };
	struct ibv_srq *srq = ibv_create_srq(pd, &si);
	if (!srq)
		fail("create_srq");
	struct ibv_qp *r = qp_new(cq, IBV_QPT_RC, srq, 0), *s = qp_new(scq, IBV_QPT_RC, NULL, 0);
	rc_connect(s, r->qp_num, 12, 7, 14, 7);
	rc_connect(r, s->qp_num, 12, 7, 14, 7);
	post_recvs(NULL, srq, 0, 4, dst, SLOTS, md);
	struct ibv_sge sge = { .addr = (uintptr_t)dst, .length = 64, .lkey = md->lkey };
	struct ibv_recv_wr wr = { .wr_id = 99, .sg_list = &sge, .num_sge = 1 }, *bad = NULL;
	if (ibv_post_srq_recv(srq, &wr, &bad) != ENOMEM || bad != &wr)
		fail("a 5th receive into a 4-deep SRQ");
	struct ibv_srq_attr sa = { .max_wr = 3 };
	if (ibv_modify_srq(srq, &sa, IBV_SRQ_MAX_WR) != EINVAL)
		fail("SRQ shrink to 3 with 4 posted accepted");
	ok("SRQ resize below the receives posted: EINVAL");
	sa.max_wr = 16;
	if (ibv_modify_srq(srq, &sa, IBV_SRQ_MAX_WR))
		fail("SRQ grow to 16");
	if (ibv_query_srq(srq, &sa) || sa.max_wr != 16)
		fail("query_srq after growing: max_wr %u", sa.max_wr);
	post_recvs(NULL, srq, 4, 12, dst, SLOTS, md);
	bad = NULL;
	if (ibv_post_srq_recv(srq, &wr, &bad) != ENOMEM || bad != &wr)
		fail("a 17th receive into a 16-deep SRQ");
	ok("SRQ grown 4 -> 16 takes 12 more receives, then ENOMEM");
	send_n(s, scq, src, ms, 10, 0x40);
	recv_n(cq, 10, 0, dst, SLOTS, 0x40, "SRQ after growing");
	ok("10 SENDs land in the SRQ's receives in order, bytes exact");
	sa.max_wr = 5;
	if (ibv_modify_srq(srq, &sa, IBV_SRQ_MAX_WR) != EINVAL)
		fail("SRQ shrink to 5 with 6 outstanding accepted");
	sa.max_wr = 6;
	if (ibv_modify_srq(srq, &sa, IBV_SRQ_MAX_WR) || ibv_query_srq(srq, &sa) || sa.max_wr != 6)
		fail("SRQ shrink to 6 with 6 outstanding: max_wr %u", sa.max_wr);
	bad = NULL;
	if (ibv_post_srq_recv(srq, &wr, &bad) != ENOMEM || bad != &wr)
		fail("a 7th receive into a 6-deep SRQ");
	ok("SRQ shrunk 16 -> 6 with 6 outstanding, then full");
	send_n(s, scq, src, ms, 6, 0x50);
	recv_n(cq, 6, 10, dst, SLOTS, 0x50, "SRQ after shrinking");
	post_recvs(NULL, srq, 16, 6, dst, SLOTS, md);
	send_n(s, scq, src, ms, 6, 0x60);
	recv_n(cq, 6, 16, dst, SLOTS, 0x60, "SRQ refilled after shrinking");
	ok("the kept receives, then 6 new ones, take SENDs in order, bytes exact");
	struct ibv_srq_attr lim = { .max_wr = 2, .srq_limit = 3 };
	if (ibv_modify_srq(srq, &lim, IBV_SRQ_MAX_WR | IBV_SRQ_LIMIT) != EINVAL)
		fail("SRQ resize below its new limit accepted");
	ok("SRQ resize below the limit set with it: EINVAL");
}

/* ibv_query_gid_ex / ibv_query_gid_table: one IB GID (the port is InfiniBand), the same as
 * ibv_query_gid's, and the kernel's errnos around it. */
static void case_gid(void)
{
	struct ibv_port_attr pa;
	if (ibv_query_port(ctx, 1, &pa))
		fail("query_port");
	struct ibv_gid_entry e;
	memset(&e, 0xAB, sizeof e);
	int r = ibv_query_gid_ex(ctx, 1, 0, &e, 0);
	if (r)
		fail("query_gid_ex(1, 0): %d", r);
	if (memcmp(&e.gid, &gid, sizeof gid) || e.gid_index != 0 || e.port_num != 1 || e.ndev_ifindex != 0)
		fail("query_gid_ex entry: index %u port %u ndev %u, gid %s ibv_query_gid's", e.gid_index, e.port_num,
		     e.ndev_ifindex, memcmp(&e.gid, &gid, sizeof gid) ? "differs from" : "is");
	if (pa.link_layer != IBV_LINK_LAYER_INFINIBAND || e.gid_type != IBV_GID_TYPE_IB)
		fail("GID type %u on link layer %u", e.gid_type, pa.link_layer);
	ok("query_gid_ex: ibv_query_gid's GID, type IB on an InfiniBand port, no net device");
	if (ibv_query_gid_ex(ctx, 1, pa.gid_tbl_len, &e, 0) != EINVAL)
		fail("query_gid_ex past gid_tbl_len");
	if (ibv_query_gid_ex(ctx, 2, 0, &e, 0) != EINVAL || ibv_query_gid_ex(ctx, 0, 0, &e, 0) != EINVAL)
		fail("query_gid_ex on port 0 or 2");
	if (ibv_query_gid_ex(ctx, 1, 0, &e, 1) != EINVAL)
		fail("query_gid_ex with flags");
	ok("query_gid_ex past gid_tbl_len, on another port, with flags: EINVAL");
	struct ibv_gid_entry t[4];
	memset(t, 0xAB, sizeof t);
	ssize_t n = ibv_query_gid_table(ctx, t, 4, 0);
	if (n != pa.gid_tbl_len || memcmp(&t[0], &e, sizeof e))
		fail("query_gid_table: %zd entries (gid_tbl_len %d), first %s query_gid_ex's", n, pa.gid_tbl_len,
		     n > 0 && memcmp(&t[0], &e, sizeof e) ? "differs from" : "is");
	uint8_t untouched[sizeof t[1]];
	memset(untouched, 0xAB, sizeof untouched);
	if (memcmp(&t[1], untouched, sizeof untouched))
		fail("query_gid_table wrote past its count");
	ok("query_gid_table: %zd entry, the same as query_gid_ex's, nothing past it", n);
	if (ibv_query_gid_table(ctx, t, 0, 0) != -EINVAL || ibv_query_gid_table(ctx, t, 4, 1) != -EINVAL)
		fail("query_gid_table with no room or flags");
	ok("query_gid_table with no room or with flags: -EINVAL");
}

/* Device memory: allocation up to max_dm_size, exact copies in and out with bounds, a zero-based
 * MR over it that RDMA WRITE, READ and SEND use, EBUSY while an MR exists. */
static void case_dm(void)
{
	struct ibv_device_attr_ex dx;
	if (ibv_query_device_ex(ctx, NULL, &dx))
		fail("query_device_ex");
	if (dx.max_dm_size < 8192)
		fail("max_dm_size %lu", (unsigned long)dx.max_dm_size);
	ok("max_dm_size reported: %lu", (unsigned long)dx.max_dm_size);
	struct ibv_alloc_dm_attr big = { .length = dx.max_dm_size + 1 };
	errno = 0;
	if (ibv_alloc_dm(ctx, &big) || errno != EINVAL)
		fail("alloc_dm past max_dm_size");
	struct ibv_alloc_dm_attr zero = { .length = 0 };
	errno = 0;
	if (ibv_alloc_dm(ctx, &zero) || errno != EINVAL)
		fail("alloc_dm of 0 bytes");
	ok("alloc_dm past max_dm_size or of 0 bytes: EINVAL");
	enum { DM = 10000 };
	struct ibv_alloc_dm_attr da = { .length = DM };
	struct ibv_dm *dm = ibv_alloc_dm(ctx, &da);
	if (!dm)
		fail("alloc_dm");
	uint8_t *host = malloc(2 * DM), *back = malloc(DM);
	for (unsigned i = 0; i < DM; i++)
		host[i] = (uint8_t)(i * 31 + 7);
	if (ibv_memcpy_to_dm(dm, 0, host, DM) || ibv_memcpy_from_dm(back, dm, 0, DM) || memcmp(back, host, DM))
		fail("memcpy to and from DM");
	memset(back, 0, DM);
	if (ibv_memcpy_from_dm(back, dm, 1001, 333) || memcmp(back, host + 1001, 333))
		fail("memcpy_from_dm at an odd offset");
	ok("memcpy_to_dm / memcpy_from_dm: exact bytes, odd offsets");
	if (ibv_memcpy_to_dm(dm, DM - 3, host, 4) != EFAULT || ibv_memcpy_from_dm(back, dm, DM, 1) != EFAULT)
		fail("copies past the end of the DM");
	ok("copies past the end of the DM: EFAULT");
	errno = 0;
	if (ibv_reg_dm_mr(pd, dm, 0, DM, IBV_ACCESS_LOCAL_WRITE) || errno != EINVAL)
		fail("reg_dm_mr without ZERO_BASED");
	errno = 0;
	if (ibv_reg_dm_mr(pd, dm, 4096, DM, IBV_ACCESS_ZERO_BASED | IBV_ACCESS_LOCAL_WRITE) || errno != EINVAL)
		fail("reg_dm_mr past the end");
	ok("reg_dm_mr without IBV_ACCESS_ZERO_BASED or past the DM's end: EINVAL");
	/* rdma-core's tests/test_mr.py registers DM MRs with IBV_ACCESS_ZERO_BASED alone, up to the
	 * DM's last byte; a copy may end exactly there too. */
	struct ibv_mr *zb = ibv_reg_dm_mr(pd, dm, DM - 1000, 1000, IBV_ACCESS_ZERO_BASED);
	if (!zb || (uintptr_t)zb->addr != DM - 1000 || ibv_dereg_mr(zb))
		fail("reg_dm_mr with IBV_ACCESS_ZERO_BASED alone up to the DM's end");
	if (ibv_memcpy_to_dm(dm, DM - 4, host + DM - 4, 4))
		fail("memcpy_to_dm ending at the DM's last byte");
	ok("reg_dm_mr with IBV_ACCESS_ZERO_BASED alone up to the DM's end, and a copy ending there: accepted");
	int acc = IBV_ACCESS_ZERO_BASED | IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
	struct ibv_mr *dmr = ibv_reg_dm_mr(pd, dm, 100, 8000, acc);
	if (!dmr)
		fail("reg_dm_mr");
	if ((uintptr_t)dmr->addr != 100 || dmr->length != 8000)
		fail("DM MR addr %p length %zu", dmr->addr, dmr->length);
	if (ibv_free_dm(dm) != EBUSY)
		fail("free_dm with an MR over it");
	ok("reg_dm_mr: addr = the DM offset; free_dm while it exists: EBUSY");
	/* The MR's bytes kept what the DM held. */
	if (ibv_memcpy_from_dm(back, dm, 0, DM) || memcmp(back, host, DM))
		fail("DM bytes after registration");
	struct ibv_cq *cq = cq_new(64);
	struct ibv_qp *a = qp_new(cq, IBV_QPT_RC, NULL, 0), *b = qp_new(cq, IBV_QPT_RC, NULL, 0);
	rc_connect(a, b->qp_num, 12, 7, 14, 7);
	rc_connect(b, a->qp_num, 12, 7, 14, 7);
	struct ibv_mr *hm = reg(host, 2 * DM, IBV_ACCESS_LOCAL_WRITE);
	/* WRITE 500 host bytes to zero-based address 1000 of the DM MR (DM offset 1100). */
	memset(host + DM, 0xA5, 500);
	if (post(a, 1, IBV_WR_RDMA_WRITE, host + DM, 500, hm->lkey, 1000, dmr->rkey, 0, 0, IBV_SEND_SIGNALED))
		fail("post WRITE");
	expect(cq, 1, IBV_WC_SUCCESS, "RDMA WRITE into the DM MR");
	if (ibv_memcpy_from_dm(back, dm, 0, DM))
		fail("memcpy_from_dm");
	for (unsigned i = 0; i < DM; i++) {
		uint8_t want = i >= 1100 && i < 1600 ? 0xA5 : (uint8_t)(i * 31 + 7);
		if (back[i] != want)
			fail("DM byte %u is %#x after the WRITE, want %#x", i, back[i], want);
	}
	ok("RDMA WRITE at zero-based address 1000 lands at DM offset 1100, nothing else changed");
	/* READ 300 bytes from zero-based 7000 (DM offset 7100) into host. */
	memset(host + DM, 0, 300);
	if (post(a, 2, IBV_WR_RDMA_READ, host + DM, 300, hm->lkey, 7000, dmr->rkey, 0, 0, IBV_SEND_SIGNALED))
		fail("post READ");
	expect(cq, 2, IBV_WC_SUCCESS, "RDMA READ from the DM MR");
	for (unsigned i = 0; i < 300; i++)
		if (host[DM + i] != (uint8_t)((7100 + i) * 31 + 7))
			fail("READ byte %u", i);
	/* Past the MR's end (zero based: 8000). */
	if (post(a, 3, IBV_WR_RDMA_READ, host + DM, 16, hm->lkey, 7990, dmr->rkey, 0, 0, IBV_SEND_SIGNALED))
		fail("post READ");
	expect(cq, 3, IBV_WC_REM_ACCESS_ERR, "RDMA READ past the DM MR's end");
	ok("RDMA READ from the DM MR: exact; past its end: REM_ACCESS_ERR");
	/* SEND from the DM MR (its lkey, zero-based address) on a fresh pair. */
	struct ibv_qp *c = qp_new(cq, IBV_QPT_RC, NULL, 0), *d = qp_new(cq, IBV_QPT_RC, NULL, 0);
	rc_connect(c, d->qp_num, 12, 7, 14, 7);
	rc_connect(d, c->qp_num, 12, 7, 14, 7);
	while (poll_for(cq, &(struct ibv_wc){ 0 }, 0.05))
		;
	recv_on(d, 9, host + DM, 256, hm->lkey);
	if (post(c, 4, IBV_WR_SEND, (void *)(uintptr_t)2000, 200, dmr->lkey, 0, 0, 0, 0, IBV_SEND_SIGNALED))
		fail("post SEND from DM");
	for (int k = 0; k < 2; k++) {
		struct ibv_wc wc = poll1(cq);
		if (wc.status || (wc.wr_id != 4 && wc.wr_id != 9))
			fail("SEND from DM: wr %lu %s", (unsigned long)wc.wr_id, ibv_wc_status_str(wc.status));
	}
	for (unsigned i = 0; i < 200; i++)
		if (host[DM + i] != (uint8_t)((2100 + i) * 31 + 7))
			fail("SEND from DM: byte %u", i);
	ok("SEND from the DM MR's lkey at zero-based 2000: the receive gets DM offset 2100..2300");
	ibv_destroy_qp(a);
	ibv_destroy_qp(b);
	ibv_destroy_qp(c);
	ibv_destroy_qp(d);
	if (ibv_dereg_mr(dmr) || ibv_free_dm(dm))
		fail("dereg_mr then free_dm");
	ok("after dereg_mr, free_dm: 0");
}

/* KiB of the vRNIC's region file ($VRNIC_DEVICE/region, sparse) that hold memory. */
static long long region_kib(void)
{
	const char *dev = getenv("VRNIC_DEVICE");
	char path[4096];
	struct stat st;
	if (!dev)
		fail("VRNIC_DEVICE not set (run under vrnic run)");
	snprintf(path, sizeof path, "%s/region", dev);
	if (stat(path, &st))
		fail("stat %s", path);
	return (long long)st.st_blocks / 2;
}

/* An RNIC-deep CQ: max_cqe is what an RNIC offers (mlx5 4 Mi - 1; libfabric's ofi_rxm asks for
 * 256 Ki), and such a CQ costs the vRNIC memory only for the completions written to it: the
 * region file (sparse) grows by under 1 MiB when a CQ of max_cqe entries is made, by about 64
 * bytes per completion while 20000 go through it, and gives it back when it is destroyed. */
static void case_big_cq(void)
{
	struct ibv_device_attr da;
	if (ibv_query_device(ctx, &da))
		fail("query_device");
	if (da.max_cqe < (1 << 22) - 1)
		fail("max_cqe %d, below an RNIC's 4 Mi - 1", da.max_cqe);
	ok("max_cqe %d, an RNIC's depth", da.max_cqe);
	struct ibv_cq *rxm = ibv_create_cq(ctx, 262144, NULL, NULL, 0);
	if (!rxm || rxm->cqe < 262144)
		fail("create_cq of 262144 entries (ofi_rxm's)");
	if (ibv_destroy_cq(rxm))
		fail("destroy_cq");
	ok("create_cq of 262144 entries, as libfabric's ofi_rxm asks: accepted");
	static uint8_t buf[4096];
	struct ibv_mr *mr = reg(buf, sizeof buf, ALL_ACCESS);
	long long before = region_kib();
	struct ibv_cq *cq = ibv_create_cq(ctx, da.max_cqe, NULL, NULL, 0);
	if (!cq || cq->cqe < da.max_cqe)
		fail("create_cq of max_cqe entries");
	long long made = region_kib();
	if (made - before > 1024)
		fail("a CQ of %d entries took %lld KiB at creation", da.max_cqe, made - before);
	ok("a CQ of %d entries (%lld MiB of ring) takes %lld KiB of memory at creation", cq->cqe,
	   (long long)cq->cqe * 64 >> 20, made - before);
	struct ibv_qp *a = qp_new(cq, IBV_QPT_RC, NULL, 0), *b = qp_new(cq, IBV_QPT_RC, NULL, 0);
	rc_connect(a, b->qp_num, 12, 7, 14, 7);
	rc_connect(b, a->qp_num, 12, 7, 14, 7);
	long long ready = region_kib();
	enum { N = 20000, BATCH = 32 };
	for (int done = 0; done < N;) {
		for (int k = 0; k < BATCH; k++)
			if (post(a, done + k, IBV_WR_RDMA_WRITE, buf, 8, mr->lkey, (uintptr_t)(buf + 64), mr->rkey, 0, 0,
				 IBV_SEND_SIGNALED))
				fail("post WRITE %d", done + k);
		for (int k = 0; k < BATCH; k++) {
			struct ibv_wc wc = poll1(cq);
			if (wc.status != IBV_WC_SUCCESS || wc.wr_id != (uint64_t)(done + k))
				fail("WRITE %d: wr %lu %s", done + k, (unsigned long)wc.wr_id, ibv_wc_status_str(wc.status));
		}
		done += BATCH;
	}
	long long used = region_kib();
	/* N completions of 64 bytes, the page the next one goes to, the queues' own pages. */
	long long bound = (long long)N * 64 / 1024 + 256;
	if (used - ready > bound)
		fail("%d completions through the CQ took %lld KiB (bound %lld)", N, used - ready, bound);
	ok("%d completions through it took %lld KiB (64 bytes each: %lld KiB)", N, used - ready,
	   (long long)N * 64 / 1024);
	if (ibv_destroy_qp(a) || ibv_destroy_qp(b) || ibv_destroy_cq(cq))
		fail("destroy");
	long long after = region_kib();
	if (after > before + 64)
		fail("after destroy the region holds %lld KiB, %lld before the CQ", after, before);
	ok("destroyed, its memory is given back (%lld KiB, %lld before)", after, before);
	ibv_dereg_mr(mr);
}

/* Sends fd over the unix socket `sock` (SCM_RIGHTS), as a process shares its context's cmd_fd. */
static void send_fd(int sock, int fd)
{
	char byte = 'f';
	struct iovec iov = { &byte, 1 };
	union {
		char buf[CMSG_SPACE(sizeof(int))];
		struct cmsghdr align;
	} u;
	memset(&u, 0, sizeof u);
	struct msghdr m = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof u.buf };
	struct cmsghdr *c = CMSG_FIRSTHDR(&m);
	c->cmsg_level = SOL_SOCKET;
	c->cmsg_type = SCM_RIGHTS;
	c->cmsg_len = CMSG_LEN(sizeof(int));
	memcpy(CMSG_DATA(c), &fd, sizeof(int));
	if (sendmsg(sock, &m, 0) != 1)
		fail("sendmsg of an fd");
}

static int recv_fd(int sock)
{
	char byte;
	struct iovec iov = { &byte, 1 };
	union {
		char buf[CMSG_SPACE(sizeof(int))];
		struct cmsghdr align;
	} u;
	struct msghdr m = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof u.buf };
	if (recvmsg(sock, &m, 0) != 1)
		fail("recvmsg of an fd");
	struct cmsghdr *c = CMSG_FIRSTHDR(&m);
	if (!c || c->cmsg_type != SCM_RIGHTS)
		fail("no fd came");
	int fd;
	memcpy(&fd, CMSG_DATA(c), sizeof(int));
	return fd;
}

/* Each import verb answers NULL with `want` in errno. */
static void expect_import_refused(struct ibv_context *c, struct ibv_pd *p, int cmd_fd, uint32_t pd_handle,
				  uint32_t mr_handle, const char *who)
{
	errno = 0;
	if (ibv_import_device(cmd_fd) || errno != EOPNOTSUPP)
		fail("%s: ibv_import_device of a context's cmd_fd: not NULL/EOPNOTSUPP", who);
	errno = 0;
	if (ibv_import_pd(c, pd_handle) || errno != EOPNOTSUPP)
		fail("%s: ibv_import_pd: not NULL/EOPNOTSUPP", who);
	errno = 0;
	if (ibv_import_mr(p, mr_handle) || errno != EOPNOTSUPP)
		fail("%s: ibv_import_mr: not NULL/EOPNOTSUPP", who);
	errno = 0;
	if (ibv_import_dm(c, 0) || errno != EOPNOTSUPP)
		fail("%s: ibv_import_dm: not NULL/EOPNOTSUPP", who);
}

/* Importing a context (ibv_import_device, _pd, _mr, _dm) is refused as by a provider without
 * import_context: NULL with EOPNOTSUPP for a context's cmd_fd, in this process and in another
 * that got the fd by SCM_RIGHTS; EINVAL for an fd that is not open (rdma-core's fstat check).
 * Nothing changes: the context goes on working. */
static void case_import(void)
{
	errno = 0;
	if (ibv_import_device(-1) || errno != EINVAL)
		fail("ibv_import_device(-1): not NULL/EINVAL");
	ok("ibv_import_device of an fd that is not open: NULL, EINVAL");
	uint8_t *buf = aligned_alloc(4096, 8192);
	memset(buf, 0x5a, 8192);
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, 8192, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	if (!mr)
		fail("reg_mr");
	int fd = dup(ctx->cmd_fd);
	if (fd < 0)
		fail("dup cmd_fd");
	expect_import_refused(ctx, pd, fd, pd->handle, mr->handle, "this process");
	close(fd);
	ok("ibv_import_device (a dup of cmd_fd), ibv_import_pd, ibv_import_mr, ibv_import_dm: NULL, EOPNOTSUPP");

	/* Another process of the vRNIC, handed the fd as an app shares a context. */
	int sv[2];
	if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv))
		fail("socketpair");
	uint32_t handles[2] = { pd->handle, mr->handle };
	fflush(stdout);
	pid_t child = fork();
	if (child < 0)
		fail("fork");
	if (child == 0) {
		close(sv[0]);
		int got = recv_fd(sv[1]);
		int n;
		struct ibv_device **list = ibv_get_device_list(&n);
		if (!list || n < 1)
			fail("child: no RDMA device");
		struct ibv_context *own = ibv_open_device(list[0]);
		ibv_free_device_list(list);
		if (!own)
			fail("child: open device");
		struct ibv_pd *own_pd = ibv_alloc_pd(own);
		if (!own_pd)
			fail("child: alloc_pd");
		expect_import_refused(own, own_pd, got, handles[0], handles[1], "another process");
		ibv_dealloc_pd(own_pd);
		ibv_close_device(own);
		fflush(stdout);
		_exit(0);
	}
	close(sv[1]);
	send_fd(sv[0], ctx->cmd_fd);
	int status;
	if (waitpid(child, &status, 0) != child || !WIFEXITED(status) || WEXITSTATUS(status))
		fail("the importing process failed (status %#x)", status);
	close(sv[0]);
	ok("another process given the cmd_fd by SCM_RIGHTS: every import NULL, EOPNOTSUPP");

	/* The context, its PD and its MR are as they were. */
	struct ibv_pd *p2 = ibv_alloc_pd(ctx);
	struct ibv_mr *m2 = p2 ? ibv_reg_mr(p2, buf, 4096, IBV_ACCESS_LOCAL_WRITE) : NULL;
	if (!p2 || !m2 || ibv_dereg_mr(m2) || ibv_dealloc_pd(p2))
		fail("the context after refused imports");
	if (ibv_dereg_mr(mr) || buf[0] != 0x5a || buf[8191] != 0x5a)
		fail("the MR after refused imports");
	free(buf);
	ok("the context works after the refused imports");
}

int main(int argc, char **argv)
{
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (argc != 2)
		fail("usage: verbs_semantics CASE");
	open_dev();
	const char *c = argv[1];
	if (!strcmp(c, "read_atomics"))
		case_read_atomics();
	else if (!strcmp(c, "hammer"))
		case_hammer();
	else if (!strcmp(c, "validate"))
		case_validate();
	else if (!strcmp(c, "rnr"))
		case_rnr();
	else if (!strcmp(c, "retry"))
		case_retry();
	else if (!strcmp(c, "srq"))
		case_srq();
	else if (!strcmp(c, "ud"))
		case_ud();
	else if (!strcmp(c, "cq_overflow"))
		case_cq_overflow();
	else if (!strcmp(c, "rereg"))
		case_rereg();
	else if (!strcmp(c, "unsignaled"))
		case_unsignaled();
	else if (!strcmp(c, "arm_once"))
		case_arm_once();
	else if (!strcmp(c, "ex"))
		case_ex();
	else if (!strcmp(c, "reg_contents"))
		case_reg_contents();
	else if (!strcmp(c, "reg_neighbours"))
		case_reg_neighbours();
	else if (!strcmp(c, "isolation"))
		case_isolation();
	else if (!strcmp(c, "limits"))
		case_limits();
	else if (!strcmp(c, "dev_limits"))
		case_dev_limits();
	else if (!strcmp(c, "queue_full"))
		case_queue_full();
	else if (!strcmp(c, "fork"))
		case_fork();
	else if (!strcmp(c, "event_stress"))
		case_event_stress();
	else if (!strcmp(c, "dm"))
		case_dm();
	else if (!strcmp(c, "big_cq"))
		case_big_cq();
	else if (!strcmp(c, "gid"))
		case_gid();
	else if (!strcmp(c, "resize"))
		case_resize();
	else if (!strcmp(c, "reg_limit"))
		case_reg_limit();
	else if (!strcmp(c, "import"))
		case_import();
	else
		fail("unknown case %s", c);
	ok("%s done", c);
	return 0;
}
