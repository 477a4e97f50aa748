/*
 * eco_check: what RDMA stacks (UCX, Open MPI) rely on beyond the verbs themselves, one
 * process on one vRNIC, each as a named case:
 *
 *   eco_check CASE
 *
 * CASE:
 *   dereg_unmapped  ibv_dereg_mr after the app unmapped part of the range (or mapped something
 *                   else there) succeeds, leaves the app's other mappings alone, and frees the
 *                   registration's memory (run it on a daemon with a small region)
 *   destroy_events  after ibv_destroy_qp returns, no async event names that QP (UCX moves a
 *                   QP on an SRQ to ERR and destroys it at once; LAST_WQE_REACHED with a NULL
 *                   element crashed its async thread)
 *   hooks           registration makes no mapping call that memory hooks see
 *   rereg_loop      a buffer registered, used and deregistered again and again costs a
 *                   fraction of its first registration
 *   huge_zeros      registering an untouched, page-aligned buffer of MADV_HUGEPAGE memory (UCX
 *                   allocates its pools so) puts no page of it in the region: the driver used
 *                   to read its first and last pages, which mapped the huge zero page over
 *                   their 2 MiB, and then copied those 4 MiB of zeros into region pages
 *   touch_after     the app's touches of a buffer it wrote and then registered cost no page
 *                   fault: the driver enters the region pages it copied the buffer into in
 *                   the page tables when it maps them over the buffer (an MPI rank registers
 *                   a buffer on its first send, then reads and writes it; a fault per page
 *                   cost about a microsecond each)
 *   maps_reads      registering fresh buffers, and again after deregistering them, reads no
 *                   byte of /proc/self/maps where the kernel answers PROCMAP_QUERY (Linux 6.11):
 *                   the driver asks for the areas of the buffer instead of reading the text of
 *                   every area of the process (an MPI rank has hundreds, each registered
 *                   buffer adds one, and formatting them cost more than the rest of a
 *                   registration)
 *
 * Prints "OK <check>" per passed check; exits 1 with "FAIL ..." on the first failure. Every wait
 * is bounded.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdarg.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "check.h"

#define PG 4096ul

static struct ibv_context *ctx;
static struct ibv_pd *pd;

/* ---- memory hooks: this program's mmap/munmap/mremap preempt libc's for every library ---- */

static volatile uintptr_t watch_lo, watch_hi;
static volatile int hook_calls, hook_hits;

static void hook_seen(const void *a, size_t len)
{
	if (!watch_hi)
		return;
	hook_calls++;
	if ((uintptr_t)a < watch_hi && (uintptr_t)a + len > watch_lo)
		hook_hits++;
}

void *mmap(void *a, size_t len, int prot, int flags, int fd, off_t off)
{
	hook_seen(a, len);
	return (void *)syscall(SYS_mmap, a, len, prot, flags, fd, off);
}

int munmap(void *a, size_t len)
{
	hook_seen(a, len);
	return (int)syscall(SYS_munmap, a, len);
}

void *mremap(void *a, size_t old, size_t len, int flags, ...)
{
	va_list ap;
	va_start(ap, flags);
	void *to = va_arg(ap, void *);
	va_end(ap);
	hook_seen(a, old);
	if (flags & MREMAP_FIXED)
		hook_seen(to, len);
	return (void *)syscall(SYS_mremap, a, old, len, flags, to);
}

/* ---- reads of /proc/self/maps: this program's open/open64/read/close preempt libc's ---- */

#define MAPS_FDS 64
static _Atomic int maps_fd_open[MAPS_FDS]; /* fd numbers below MAPS_FDS open on the maps */
static _Atomic long maps_bytes, maps_opens;

static int open_path(const char *path, int flags, va_list ap)
{
	mode_t mode = (flags & (O_CREAT | O_TMPFILE)) ? va_arg(ap, mode_t) : 0;
	int fd = (int)syscall(SYS_openat, AT_FDCWD, path, flags, mode);
	if (fd >= 0 && fd < MAPS_FDS)
		maps_fd_open[fd] = !strcmp(path, "/proc/self/maps");
	if (fd >= 0 && !strcmp(path, "/proc/self/maps"))
		maps_opens++;
	return fd;
}

int open(const char *path, int flags, ...)
{
	va_list ap;
	va_start(ap, flags);
	int fd = open_path(path, flags, ap);
	va_end(ap);
	return fd;
}

int open64(const char *path, int flags, ...)
{
	va_list ap;
	va_start(ap, flags);
	int fd = open_path(path, flags, ap);
	va_end(ap);
	return fd;
}

ssize_t read(int fd, void *buf, size_t n)
{
	ssize_t r = syscall(SYS_read, fd, buf, n);
	if (r > 0 && fd >= 0 && fd < MAPS_FDS && maps_fd_open[fd])
		maps_bytes += r;
	return r;
}

int close(int fd)
{
	if (fd >= 0 && fd < MAPS_FDS)
		maps_fd_open[fd] = 0;
	return (int)syscall(SYS_close, fd);
}

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
}

static uint8_t *map_pages(size_t pages)
{
	void *p = mmap(NULL, pages * PG, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED)
		fail("mmap %zu pages", pages);
	return p;
}

static void fill(uint8_t *p, size_t pages, uint8_t seed)
{
	for (size_t i = 0; i < pages * PG; i++)
		p[i] = (uint8_t)(seed + i * 7 + i / PG);
}

/* Whether pages first..first+pages of `p` still hold what fill(p, .., seed) wrote. */
static int holds(const uint8_t *p, size_t first, size_t pages, uint8_t seed)
{
	for (size_t i = first * PG; i < (first + pages) * PG; i++)
		if (p[i] != (uint8_t)(seed + i * 7 + i / PG))
			return 0;
	return 1;
}

/* The permissions /proc/self/maps shows for the page at `p` ("" if unmapped). */
static const char *perms_at(const void *p)
{
	static char perms[8];
	FILE *f = fopen("/proc/self/maps", "r");
	if (!f)
		fail("open /proc/self/maps");
	char line[512];
	perms[0] = 0;
	while (fgets(line, sizeof line, f)) {
		unsigned long lo, hi;
		char pr[8];
		if (sscanf(line, "%lx-%lx %7s", &lo, &hi, pr) == 3 && lo <= (uintptr_t)p && (uintptr_t)p < hi) {
			strcpy(perms, pr);
			break;
		}
	}
	fclose(f);
	return perms;
}

static struct ibv_mr *reg(void *p, size_t n)
{
	struct ibv_mr *mr = ibv_reg_mr(pd, p, n, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
							  IBV_ACCESS_REMOTE_READ);
	if (!mr)
		fail("reg_mr %zu bytes", n);
	return mr;
}

static void case_dereg_unmapped(void)
{
	/* A hole in the middle. */
	uint8_t *b = map_pages(32);
	fill(b, 32, 1);
	struct ibv_mr *mr = reg(b + 100, 32 * PG - 200);
	if (munmap(b + 8 * PG, 8 * PG))
		fail("munmap the middle");
	int r = ibv_dereg_mr(mr);
	if (r)
		fail("dereg_mr with the middle unmapped returned %d", r);
	if (!holds(b, 0, 8, 1) || !holds(b, 16, 16, 1))
		fail("the pages still mapped lost their bytes");
	memset(b, 0xab, 8 * PG);
	memset(b + 16 * PG, 0xcd, 16 * PG);
	if (strcmp(perms_at(b + 8 * PG), ""))
		fail("the unmapped hole is mapped again (%s)", perms_at(b + 8 * PG));
	ok("dereg_mr with the middle unmapped: 0, the rest keeps its bytes and stays writable");

	/* Head and tail gone, and everything gone. */
	uint8_t *c = map_pages(16);
	fill(c, 16, 2);
	mr = reg(c, 16 * PG);
	munmap(c, 4 * PG);
	munmap(c + 12 * PG, 4 * PG);
	if ((r = ibv_dereg_mr(mr)))
		fail("dereg_mr with head and tail unmapped returned %d", r);
	if (!holds(c, 4, 8, 2))
		fail("the middle lost its bytes");
	munmap(c + 4 * PG, 8 * PG);
	uint8_t *d = map_pages(8);
	mr = reg(d, 8 * PG);
	munmap(d, 8 * PG);
	if ((r = ibv_dereg_mr(mr)))
		fail("dereg_mr of a wholly unmapped range returned %d", r);
	ok("dereg_mr with head and tail unmapped, and wholly unmapped: 0");

	/* Other memory mapped where the registration was: left exactly as the app made it. */
	uint8_t *e = map_pages(16);
	fill(e, 16, 3);
	mr = reg(e, 16 * PG);
	if (mmap(e + 4 * PG, 4 * PG, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) == MAP_FAILED)
		fail("map PROT_NONE over part");
	if (mmap(e + 8 * PG, 4 * PG, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) ==
	    MAP_FAILED)
		fail("map fresh memory over part");
	memset(e + 8 * PG, 99, 4 * PG);
	if ((r = ibv_dereg_mr(mr)))
		fail("dereg_mr with other memory over part returned %d", r);
	if (strcmp(perms_at(e + 4 * PG), "---p"))
		fail("the app's PROT_NONE pages became %s", perms_at(e + 4 * PG));
	for (size_t i = 8 * PG; i < 12 * PG; i++)
		if (e[i] != 99)
			fail("the app's new pages were overwritten");
	if (!holds(e, 0, 4, 3) || !holds(e, 12, 4, 3))
		fail("the registered pages still mapped lost their bytes");
	ok("dereg_mr with other memory mapped over part: 0, that memory untouched");

	/* Nothing leaks: 64 rounds of 32 MiB, unmapped before deregistration, on a 1 GiB region. */
	for (int i = 0; i < 64; i++) {
		size_t pages = (32u << 20) / PG;
		uint8_t *f = map_pages(pages);
		f[0] = (uint8_t)i;
		f[pages * PG - 1] = (uint8_t)i;
		mr = reg(f, pages * PG);
		munmap(f, pages * PG);
		if ((r = ibv_dereg_mr(mr)))
			fail("round %d: dereg_mr returned %d", i, r);
	}
	ok("64 x 32 MiB registered, unmapped, deregistered on a 1 GiB vRNIC: the memory comes back");
}

/* Every pending async event, within `ms`; fails on any that names no object or `dead`. */
static int drain_events(int ms, void *dead)
{
	int n = 0;
	struct pollfd p = { .fd = ctx->async_fd, .events = POLLIN };
	while (poll(&p, 1, ms) == 1) {
		struct ibv_async_event ev;
		if (ibv_get_async_event(ctx, &ev))
			fail("get_async_event after poll said readable");
		if (ev.event_type != IBV_EVENT_PORT_ACTIVE && (!ev.element.qp || ev.element.qp == dead))
			fail("%s for a destroyed QP (element %p)", ibv_event_type_str(ev.event_type),
			     (void *)ev.element.qp);
		ibv_ack_async_event(&ev);
		n++;
	}
	return n;
}

static struct ibv_qp *srq_qp(struct ibv_cq *cq, struct ibv_srq *srq)
{
	struct ibv_qp_init_attr ia = { .send_cq = cq, .recv_cq = cq, .srq = srq, .qp_type = IBV_QPT_RC,
				       .cap = { .max_send_wr = 16, .max_send_sge = 1 } };
	struct ibv_qp *qp = ibv_create_qp(pd, &ia);
	if (!qp)
		fail("create_qp on the SRQ");
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1 };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
		fail("modify INIT");
	return qp;
}

static void to_err(struct ibv_qp *qp)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_ERR };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE))
		fail("modify ERR");
}

static void case_destroy_events(void)
{
	struct ibv_cq *cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	struct ibv_srq_init_attr sa = { .attr = { .max_wr = 16, .max_sge = 1 } };
	struct ibv_srq *srq = ibv_create_srq(pd, &sa);
	if (!cq || !srq)
		fail("create cq/srq");
	drain_events(200, NULL);

	/* The event exists: a QP on the SRQ that goes to ERR and lives gets it, naming it. */
	struct ibv_qp *live = srq_qp(cq, srq);
	to_err(live);
	struct pollfd p = { .fd = ctx->async_fd, .events = POLLIN };
	if (poll(&p, 1, 20000) != 1)
		fail("no async event for a live QP moved to ERR");
	struct ibv_async_event ev;
	if (ibv_get_async_event(ctx, &ev))
		fail("get_async_event");
	if (ev.event_type != IBV_EVENT_QP_LAST_WQE_REACHED || ev.element.qp != live)
		fail("got %s for %p, expected QP_LAST_WQE_REACHED for %p", ibv_event_type_str(ev.event_type),
		     (void *)ev.element.qp, (void *)live);
	ibv_ack_async_event(&ev);
	ok("a live QP on an SRQ moved to ERR: QP_LAST_WQE_REACHED naming it");

	/* Moved to ERR and destroyed at once, 100 times: none of their events comes out, and the
	 * fd does not stay readable for them. */
	for (int i = 0; i < 100; i++) {
		struct ibv_qp *qp = srq_qp(cq, srq);
		to_err(qp);
		if (i % 2)
			usleep(2000); /* let the event reach the driver first, half of the time */
		if (ibv_destroy_qp(qp))
			fail("destroy_qp");
		drain_events(0, qp);
	}
	if (poll(&p, 1, 300) != 0) {
		drain_events(0, NULL);
		fail("async_fd readable after the QPs were destroyed");
	}
	ok("100 QPs on an SRQ moved to ERR and destroyed: no event after destroy, async_fd quiet");

	/* The same with a blocking reader waiting in another round: a live QP's event still comes
	 * through after all those withdrawals. */
	struct ibv_qp *last = srq_qp(cq, srq);
	to_err(last);
	if (poll(&p, 1, 20000) != 1 || ibv_get_async_event(ctx, &ev))
		fail("no event for a live QP after the withdrawals");
	if (ev.element.qp != last)
		fail("event names %p, expected %p", (void *)ev.element.qp, (void *)last);
	ibv_ack_async_event(&ev);
	ok("events of live QPs still delivered after withdrawals");
	ibv_destroy_qp(live);
	ibv_destroy_qp(last);
	ibv_destroy_srq(srq);
	ibv_destroy_cq(cq);
}


static void case_hooks(void)
{
	size_t len = 4u << 20;
	uint8_t *b = map_pages(len / PG);
	fill(b, len / PG, 5);
	/* The hooks see the program's own calls: the check can fail. */
	watch_lo = (uintptr_t)b;
	watch_hi = (uintptr_t)b + len;
	munmap(b + len - PG, 0);
	if (hook_hits != 1)
		fail("the interposed munmap saw %d calls of the program's own", hook_hits);
	hook_calls = hook_hits = 0;
	for (int i = 0; i < 20; i++) {
		struct ibv_mr *mr = reg(b + 10, len - 20);
		if (ibv_dereg_mr(mr))
			fail("dereg_mr");
	}
	int calls = hook_calls, hits = hook_hits;
	watch_hi = 0;
	if (hits)
		fail("registration made %d mapping calls over the buffer that memory hooks see", hits);
	if (!holds(b, 0, len / PG, 5))
		fail("the buffer lost its bytes");
	ok("20 x reg/dereg of 4 MiB: %d mapping calls over the buffer visible to hooks (%d in all)", hits,
	   calls);
}

/* An RC QP connected to itself, for RDMA WRITEs into this process's own memory. */
static struct ibv_qp *self_qp(struct ibv_cq *cq)
{
	struct ibv_qp_init_attr ia = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC, .sq_sig_all = 1,
				       .cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 1,
						.max_recv_sge = 1 } };
	struct ibv_qp *qp = ibv_create_qp(pd, &ia);
	struct ibv_port_attr pa;
	if (!qp || ibv_query_port(ctx, 1, &pa))
		fail("create_qp/query_port");
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1,
				 .qp_access_flags = IBV_ACCESS_REMOTE_WRITE };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
		fail("INIT");
	a = (struct ibv_qp_attr){ .qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_4096, .dest_qp_num = qp->qp_num,
				  .max_dest_rd_atomic = 1, .min_rnr_timer = 1,
				  .ah_attr = { .dlid = pa.lid, .port_num = 1 } };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
					  IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
		fail("RTR");
	a = (struct ibv_qp_attr){ .qp_state = IBV_QPS_RTS, .timeout = 14, .retry_cnt = 7, .rnr_retry = 7,
				  .max_rd_atomic = 1 };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
					  IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
		fail("RTS");
	return qp;
}

static void write_into(struct ibv_qp *qp, struct ibv_cq *cq, struct ibv_mr *src, size_t n, uint64_t dst,
		       uint32_t rkey)
{
	struct ibv_sge sge = { .addr = (uintptr_t)src->addr, .length = (uint32_t)n, .lkey = src->lkey };
	struct ibv_send_wr wr = { .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
				  .wr.rdma = { .remote_addr = dst, .rkey = rkey } }, *bad;
	if (ibv_post_send(qp, &wr, &bad))
		fail("post WRITE");
	struct ibv_wc wc;
	double deadline = now() + 20;
	int got;
	while ((got = ibv_poll_cq(cq, 1, &wc)) == 0 && now() < deadline)
		;
	if (got != 1 || wc.status != IBV_WC_SUCCESS)
		fail("WRITE completion: %s", got == 1 ? ibv_wc_status_str(wc.status) : "none");
}

static void case_rereg_loop(void)
{
	size_t len = 8u << 20, chunk = 64u << 10;
	struct ibv_cq *cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	if (!cq)
		fail("create_cq");
	struct ibv_qp *qp = self_qp(cq);
	uint8_t *src = map_pages(chunk / PG);
	struct ibv_mr *smr = reg(src, chunk);
	uint8_t *b = map_pages(len / PG);
	fill(b, len / PG, 7);
	int rounds = 200;
	double t0 = now();
	struct ibv_mr *mr = reg(b, len);
	double first = now() - t0;
	double t1 = now();
	for (int i = 0; i < rounds; i++) {
		/* use: an RDMA WRITE into a different part each round, seen by the app at once */
		size_t at = ((size_t)i * 37 % (len / chunk)) * chunk;
		memset(src, (uint8_t)(i + 1), chunk);
		write_into(qp, cq, smr, chunk, (uintptr_t)b + at, mr->rkey);
		for (size_t k = 0; k < chunk; k += 4093)
			if (b[at + k] != (uint8_t)(i + 1))
				fail("round %d: the WRITE into the re-registered buffer is not seen", i);
		b[at] = 0x5a; /* the app writes too */
		if (ibv_dereg_mr(mr))
			fail("dereg_mr");
		mr = reg(b, len);
		if (b[at] != 0x5a)
			fail("round %d: registering again lost the app's byte", i);
	}
	double per = (now() - t1) / rounds;
	ok("%d rounds of WRITE, dereg, reg of 8 MiB: every WRITE seen", rounds);
	printf("first registration %.1f us, a round %.1f us (%.2f of the first)\n", first * 1e6, per * 1e6,
	       per / first);
	if (per > first / 3)
		fail("a round costs %.1f us, the first registration %.1f us", per * 1e6, first * 1e6);
	ok("a round costs a fraction of the first registration");
	ibv_dereg_mr(mr);
	ibv_dereg_mr(smr);
	ibv_destroy_qp(qp);
	ibv_destroy_cq(cq);
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

/* The first line of a file under /sys into w[128] (empty where it cannot be read). */
static const char *sys_line(const char *path, char *w)
{
	w[0] = 0;
	FILE *f = fopen(path, "r");
	if (f) {
		if (!fgets(w, 128, f))
			w[0] = 0;
		fclose(f);
	}
	w[strcspn(w, "\n")] = 0;
	return w;
}

static void case_huge_zeros(void)
{
	char thp_w[128], zero_w[128];
	const char *thp = sys_line("/sys/kernel/mm/transparent_hugepage/enabled", thp_w);
	const char *zero = sys_line("/sys/kernel/mm/transparent_hugepage/use_zero_page", zero_w);
	if (strstr(thp, "[never]") || !strstr(thp, "[") || strcmp(zero, "1")) {
		ok("no transparent huge zero page here (enabled: %s; use_zero_page: %s)", thp, zero);
		ok("0 KiB of zeros copied (not asked of this kernel)");
		return;
	}
	size_t huge = 2u << 20, len = 8u << 20;
	uint8_t *raw = map_pages((len + huge) / PG);
	uint8_t *b = (uint8_t *)(((uintptr_t)raw + huge - 1) / huge * huge);
	if (madvise(b, len, MADV_HUGEPAGE))
		fail("madvise MADV_HUGEPAGE");
	long long before = region_kib();
	struct ibv_mr *mr = reg(b, len);
	long long grew = region_kib() - before;
	for (size_t i = 0; i < len; i += 4093)
		if (b[i])
			fail("byte %zu of the untouched buffer reads %u", i, b[i]);
	if (grew >= 1024)
		fail("registering 8 MiB of untouched MADV_HUGEPAGE memory put %lld KiB in the region",
		     grew);
	ok("8 MiB of untouched MADV_HUGEPAGE memory registered: the region grew by %lld KiB", grew);
	ok("0 KiB of zeros copied");
	if (ibv_dereg_mr(mr))
		fail("dereg_mr");
}

/* Minor page faults of this process so far. */
static long minor_faults(void)
{
	struct rusage ru;
	if (getrusage(RUSAGE_SELF, &ru))
		fail("getrusage");
	return ru.ru_minflt;
}

static void case_touch_after(void)
{
	size_t pages = 256;
	uint8_t *b = map_pages(pages);
	fill(b, pages, 9);
	struct ibv_mr *mr = reg(b, pages * PG);
	long f0 = minor_faults();
	for (size_t p = 0; p < pages; p++)
		b[p * PG + 1] ^= 0xff; /* a read and a write of every page */
	long faults = minor_faults() - f0;
	for (size_t p = 0; p < pages; p++)
		b[p * PG + 1] ^= 0xff;
	if (!holds(b, 0, pages, 9))
		fail("the registered buffer lost its bytes");
	if (faults >= (long)pages / 8)
		fail("touching the %zu pages of a registered buffer took %ld page faults", pages, faults);
	ok("touching the %zu pages of a registered buffer took %ld page faults", pages, faults);
	ok("no fault per page after registration");
	if (ibv_dereg_mr(mr))
		fail("dereg_mr");
}

/* struct procmap_query of <linux/fs.h> (Linux 6.11; older headers lack it). */
struct maps_query {
	uint64_t size, query_flags, query_addr, vma_start, vma_end, vma_flags, vma_page_size,
		vma_offset, inode;
	uint32_t dev_major, dev_minor, vma_name_size, build_id_size;
	uint64_t vma_name_addr, build_id_addr;
};
#define MAPS_QUERY _IOWR('f', 17, struct maps_query)

/* Whether this kernel answers PROCMAP_QUERY on /proc/self/maps. */
static int has_procmap_query(void)
{
	int fd = open("/proc/self/maps", O_RDONLY);
	if (fd < 0)
		fail("open /proc/self/maps");
	struct maps_query q = {.size = sizeof q, .query_addr = (uintptr_t)&has_procmap_query};
	int r = ioctl(fd, MAPS_QUERY, &q);
	close(fd);
	return r == 0;
}

static void case_maps_reads(void)
{
	int query = has_procmap_query();
	/* An MPI rank's worth of areas, so that reading them as text would cost what it costs there. */
	for (int i = 0; i < 200; i++)
		if (mmap(NULL, PG, i % 2 ? PROT_READ : PROT_READ | PROT_WRITE,
			 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) == MAP_FAILED)
			fail("mmap");
	int bufs = 16, pages = 16;
	long bytes0 = maps_bytes, opens0 = maps_opens;
	for (int i = 0; i < bufs; i++) {
		uint8_t *b = map_pages(pages);
		fill(b, pages, (uint8_t)i);
		/* fresh pages moved onto the region; then parked, and taken back */
		struct ibv_mr *mr = reg(b, pages * PG);
		if (ibv_dereg_mr(mr))
			fail("dereg_mr");
		mr = reg(b, pages * PG);
		if (ibv_dereg_mr(mr))
			fail("dereg_mr");
		if (!holds(b, 0, pages, (uint8_t)i))
			fail("buffer %d lost its bytes", i);
	}
	long bytes = maps_bytes - bytes0, opens = maps_opens - opens0;
	if (!query) {
		ok("kernel without PROCMAP_QUERY: %d x (reg, dereg, reg, dereg) read %ld bytes of "
		   "/proc/self/maps (the text, as before Linux 6.11)",
		   bufs, bytes);
		ok("0 bytes of /proc/self/maps read (not asked of this kernel)");
		return;
	}
	if (bytes)
		fail("%d x (reg, dereg, reg, dereg) read %ld bytes of /proc/self/maps (%ld opens)", bufs,
		     bytes, opens);
	ok("%d x (reg, dereg, reg, dereg): 0 bytes of /proc/self/maps read (%ld opens for "
	   "PROCMAP_QUERY)",
	   bufs, opens);
}

int main(int argc, char **argv)
{
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (argc != 2)
		fail("usage: eco_check CASE");
	open_dev();
	const char *c = argv[1];
	if (!strcmp(c, "dereg_unmapped"))
		case_dereg_unmapped();
	else if (!strcmp(c, "destroy_events"))
		case_destroy_events();
	else if (!strcmp(c, "hooks"))
		case_hooks();
	else if (!strcmp(c, "rereg_loop"))
		case_rereg_loop();
	else if (!strcmp(c, "huge_zeros"))
		case_huge_zeros();
	else if (!strcmp(c, "touch_after"))
		case_touch_after();
	else if (!strcmp(c, "maps_reads"))
		case_maps_reads();
	else
		fail("unknown case %s", c);
	ok("%s done", c);
	return 0;
}
