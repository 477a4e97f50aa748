// pollbench: ns per empty ibv_poll_cq on a CQ with a completion channel (as UCX's are), 4 CQs polled in turn.
#include <infiniband/verbs.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e9+t.tv_nsec;}
int main(int argc,char**argv){
  int n; struct ibv_device**l=ibv_get_device_list(&n); if(!l||!n){fprintf(stderr,"no device\n");return 1;}
  struct ibv_context*c=ibv_open_device(l[0]); if(!c){fprintf(stderr,"open\n");return 1;}
  struct ibv_comp_channel*ch=ibv_create_comp_channel(c);
  struct ibv_cq*cq[4]; for(int i=0;i<4;i++){cq[i]=ibv_create_cq(c,64,0,argc>1?NULL:ch,0); ibv_req_notify_cq(cq[i],0);}
  struct ibv_wc wc[16]; long iters=20000000; double best=1e18;
  for(int r=0;r<5;r++){ double t0=now(); long got=0;
    for(long i=0;i<iters;i++) got+=ibv_poll_cq(cq[i&3],16,wc);
    double dt=(now()-t0)/iters; if(dt<best)best=dt; if(got) printf("got %ld\n",got);}
  printf("empty ibv_poll_cq: %.1f ns (best of 5 x %ld)\n",best,iters);
  return 0;}
