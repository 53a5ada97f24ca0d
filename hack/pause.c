/* The pod sandbox's "pause" process, as Kubernetes' upstream pause: PID 1 of the pod, holds the
 * pod's namespaces, reaps zombies, exits on SIGINT/SIGTERM. hack/container-engine.sh compiles it
 * statically (gcc -static -Os) into diloco.local/pause:3.10, because registry.k8s.io is out of reach. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#define VERSION "3.10-diloco"

static void on_stop(int sig) {
  (void)sig;
  _exit(0);
}

static void on_child(int sig) {
  (void)sig;
  int saved = errno;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
  errno = saved;
}

int main(int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "-v") == 0) {
      printf("pause.c %s\n", VERSION);
      return 0;
    }
  }
  if (getpid() != 1) {
    fprintf(stderr, "Warning: pause should be the first process\n");
  }
  struct sigaction stop = {.sa_handler = on_stop};
  struct sigaction child = {.sa_handler = on_child, .sa_flags = SA_NOCLDSTOP};
  if (sigaction(SIGINT, &stop, NULL) < 0) return 1;
  if (sigaction(SIGTERM, &stop, NULL) < 0) return 2;
  if (sigaction(SIGCHLD, &child, NULL) < 0) return 3;
  for (;;) pause();
  fprintf(stderr, "Error: infinite loop terminated\n");
  return 42;
}
