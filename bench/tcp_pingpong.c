/* A TCP ping-pong of small messages, the limit the across-host latency rows are measured
 * against: the same veth, TCP_NODELAY, and both sides spinning on non-blocking reads, as the
 * perftest latency programs spin on their CQs.
 *
 *   tcp_pingpong server PORT
 *   tcp_pingpong client ADDR PORT SIZE ITERS   -> prints the median half round trip in us
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static double now_us(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

/* Reads exactly n bytes, spinning on a non-blocking socket. */
static int spin_read(int fd, char *buf, size_t n)
{
	size_t got = 0;
	while (got < n) {
		ssize_t r = recv(fd, buf + got, n - got, MSG_DONTWAIT);
		if (r > 0)
			got += r;
		else if (r == 0 || (errno != EAGAIN && errno != EINTR))
			return -1;
	}
	return 0;
}

static int cmp(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
	int one = 1;
	if (argc == 3 && !strcmp(argv[1], "server")) {
		int ls = socket(AF_INET, SOCK_STREAM, 0);
		struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(atoi(argv[2])) };
		setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
		if (bind(ls, (struct sockaddr *)&a, sizeof a) || listen(ls, 1))
			return perror("bind"), 1;
		int fd = accept(ls, NULL, NULL);
		setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
		char buf[65536];
		unsigned size;
		if (spin_read(fd, (char *)&size, sizeof size) || size > sizeof buf)
			return 1;
		while (!spin_read(fd, buf, size))
			if (send(fd, buf, size, 0) != (ssize_t)size)
				return 1;
		return 0;
	}
	if (argc != 6 || strcmp(argv[1], "client"))
		return fprintf(stderr, "usage: tcp_pingpong server PORT | client ADDR PORT SIZE ITERS\n"), 2;
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(atoi(argv[3])) };
	inet_pton(AF_INET, argv[2], &a.sin_addr);
	for (int i = 0; connect(fd, (struct sockaddr *)&a, sizeof a); i++) {
		if (i > 100)
			return perror("connect"), 1;
		usleep(50000);
		close(fd);
		fd = socket(AF_INET, SOCK_STREAM, 0);
	}
	setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
	unsigned size = atoi(argv[4]);
	int iters = atoi(argv[5]);
	char buf[65536] = { 0 };
	if (size > sizeof buf || send(fd, &size, sizeof size, 0) != sizeof size)
		return 1;
	double *half = calloc(iters, sizeof *half);
	for (int i = 0; i < iters; i++) {
		double t = now_us();
		if (send(fd, buf, size, 0) != (ssize_t)size || spin_read(fd, buf, size))
			return 1;
		half[i] = (now_us() - t) / 2;
	}
	qsort(half, iters, sizeof *half, cmp);
	printf("%.2f\n", half[iters / 2]);
	return 0;
}
