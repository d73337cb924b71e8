import torch, torch.nn.functional as F, time
from torch.nn.attention import sdpa_kernel, SDPBackend
print(torch.__version__)
dev='cuda'; dt=torch.bfloat16
B,nh,nkv,S,d=2,64,8,4096,64
for qd, vd in [(72,64),(72,72),(65,64)]:
    for be in [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]:
        q=torch.randn(B,nh,S,qd,device=dev,dtype=dt,requires_grad=True); k=torch.randn(B,nkv,S+1,qd,device=dev,dtype=dt,requires_grad=True); v=torch.randn(B,nkv,S+1,vd,device=dev,dtype=dt,requires_grad=True)
        i=torch.arange(S,device=dev)[:,None]; j=torch.arange(S+1,device=dev)[None]
        m=(j<=i+1)
        try:
            with sdpa_kernel([be]):
                f=lambda: F.scaled_dot_product_attention(q,k,v,attn_mask=m,scale=0.125,enable_gqa=True)
                o=f(); o.sum().backward(); torch.cuda.synchronize()
                t=time.perf_counter()
                for _ in range(5): o=f(); o.sum().backward()
                torch.cuda.synchronize(); ms=(time.perf_counter()-t)/5*1e3
            print(qd,vd,be,'ok fwd+bwd ms',round(ms,2))
        except Exception as e: print(qd,vd,be,'FAIL',str(e).split('\n')[0][:150])
# baseline: flash causal, no mask, d=64
q=torch.randn(B,nh,S,64,device=dev,dtype=dt,requires_grad=True); k=torch.randn(B,nkv,S,64,device=dev,dtype=dt,requires_grad=True); v=torch.randn(B,nkv,S,64,device=dev,dtype=dt,requires_grad=True)
f=lambda: F.scaled_dot_product_attention(q,k,v,is_causal=True,enable_gqa=True)
o=f(); o.sum().backward(); torch.cuda.synchronize(); t=time.perf_counter()
for _ in range(5): o=f(); o.sum().backward()
torch.cuda.synchronize(); print('flash causal baseline ms', (time.perf_counter()-t)/5*1e3)
