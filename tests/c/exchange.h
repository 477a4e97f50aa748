/*
 * exchange.h: the TCP side channel of our two-process C checks (as ibv_rc_pingpong swaps
 * LID/QPN over TCP): exact-length send/receive, a client that retries while the server is not
 * listening yet, a server that takes one connection. Include after check.h.
 */
#ifndef VRNIC_EXCHANGE_H
#define VRNIC_EXCHANGE_H

#include <arpa/inet.h>
#include <netdb.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

static void xfer(int sock, void *buf, size_t len, int send_it)
{
	size_t done = 0;
	while (done < len) {
		ssize_t n = send_it ? send(sock, (char *)buf + done, len - done, MSG_NOSIGNAL)
				    : recv(sock, (char *)buf + done, len - done, 0);
		if (n <= 0)
			fail("socket %s", send_it ? "send" : "recv");
		done += n;
	}
}

static int connect_to(const char *host, const char *port)
{
	struct addrinfo hints = { .ai_family = AF_INET, .ai_socktype = SOCK_STREAM }, *res;
	for (int i = 0; i < 100; i++) {
		if (getaddrinfo(host, port, &hints, &res) == 0) {
			int fd = socket(res->ai_family, res->ai_socktype, 0);
			if (connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
				freeaddrinfo(res);
				return fd;
			}
			close(fd);
			freeaddrinfo(res);
		}
		usleep(100000);
	}
	fail("connect to %s:%s", host, port);
	return -1;
}

/* Unused by checks that take several connections (atomic_check). */
static __attribute__((unused)) int listen_on(const char *port)
{
	int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(atoi(port)) };
	setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
	if (bind(fd, (struct sockaddr *)&a, sizeof a) || listen(fd, 1))
		fail("listen on %s", port);
	int c = accept(fd, NULL, NULL);
	close(fd);
	return c;
}

#endif
