/* One TCP stream as fast as plain sockets go: the limit the across-host bandwidth row is
 * measured against, beside iperf3. The sender writes 64 KiB buffers (a peer link's frame
 * size; on the 2-core machine they went faster than 4 MiB ones), the receiver reads into one,
 * both on non-blocking sockets that they spin on, with TCP_NODELAY, as a vrnic daemon drives
 * its peer link, for SECONDS seconds.
 *
 *   tcp_stream server PORT            -> prints the bytes received per second, in MB/s (1e6)
 *   tcp_stream client ADDR PORT SECONDS
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define BUF (64 << 10)

static double now_s(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
	char *buf = malloc(BUF);
	if (!buf)
		return 1;
	memset(buf, 0x5a, BUF);
	if (argc == 3 && !strcmp(argv[1], "server")) {
		int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
		setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
		struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(atoi(argv[2])) };
		if (bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, 1)) {
			perror("bind/listen");
			return 1;
		}
		int fd = accept(l, NULL, NULL);
		if (fd < 0) {
			perror("accept");
			return 1;
		}
		fcntl(fd, F_SETFL, O_NONBLOCK);
		double t0 = 0, t1 = 0;
		unsigned long long total = 0;
		for (;;) {
			ssize_t n = read(fd, buf, BUF);
			if (n < 0 && (errno == EAGAIN || errno == EINTR))
				continue;
			if (n <= 0)
				break;
			if (!t0)
				t0 = now_s();
			else
				total += n;
			t1 = now_s();
		}
		printf("%.0f\n", t1 > t0 ? total / (t1 - t0) / 1e6 : 0.0);
		return 0;
	}
	if (argc == 5 && !strcmp(argv[1], "client")) {
		int fd = socket(AF_INET, SOCK_STREAM, 0);
		struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(atoi(argv[3])) };
		inet_pton(AF_INET, argv[2], &a.sin_addr);
		if (connect(fd, (struct sockaddr *)&a, sizeof a)) {
			perror("connect");
			return 1;
		}
		int one = 1;
		setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
		fcntl(fd, F_SETFL, O_NONBLOCK);
		double end = now_s() + atof(argv[4]);
		while (now_s() < end) {
			size_t off = 0;
			while (off < BUF) {
				ssize_t n = write(fd, buf + off, BUF - off);
				if (n < 0 && (errno == EAGAIN || errno == EINTR))
					continue;
				if (n <= 0) {
					perror("write");
					return 1;
				}
				off += n;
			}
		}
		close(fd);
		return 0;
	}
	fprintf(stderr, "usage: tcp_stream server PORT | client ADDR PORT SECONDS\n");
	return 2;
}
