/* Tandem's bind guard: preloaded (LD_PRELOAD) into a process that runs a library which listens
 * on every interface whatever it is told (Mooncake's store client and master). While
 * TANDEM_BIND_HOST names an address, a bind() to the wildcard address (0.0.0.0, or :: on a
 * dual-stack socket) binds that address instead; an IPv4 address on an IPv6 socket is bound
 * as its v4-mapped form. Any other bind() is passed through unchanged. See bind_guard.py. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

/* Looked up by bind_guard.py to tell whether the guard is loaded in a process. */
int tandem_bind_guard_version = 1;

static bind_fn real_bind(void) {
    static bind_fn fn;
    if (!fn) fn = (bind_fn)dlsym(RTLD_NEXT, "bind");
    return fn;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    const char *host = getenv("TANDEM_BIND_HOST");
    if (host == NULL || *host == '\0' || addr == NULL) return real_bind()(fd, addr, len);
    if (addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        struct sockaddr_in in = *(const struct sockaddr_in *)addr;
        if (in.sin_addr.s_addr == htonl(INADDR_ANY) && inet_pton(AF_INET, host, &in.sin_addr) == 1)
            return real_bind()(fd, (const struct sockaddr *)&in, sizeof in);
    } else if (addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 in6 = *(const struct sockaddr_in6 *)addr;
        struct in_addr v4;
        if (memcmp(&in6.sin6_addr, &in6addr_any, sizeof in6addr_any) == 0) {
            if (inet_pton(AF_INET, host, &v4) == 1) {
                memset(&in6.sin6_addr, 0, sizeof in6.sin6_addr);
                in6.sin6_addr.s6_addr[10] = 0xff;
                in6.sin6_addr.s6_addr[11] = 0xff;
                memcpy(&in6.sin6_addr.s6_addr[12], &v4, sizeof v4);
                return real_bind()(fd, (const struct sockaddr *)&in6, sizeof in6);
            }
            if (inet_pton(AF_INET6, host, &in6.sin6_addr) == 1)
                return real_bind()(fd, (const struct sockaddr *)&in6, sizeof in6);
        }
    }
    return real_bind()(fd, addr, len);
}
