// NOT Apple's header. A stand-in declaring exactly the Metal subset that src/metal/device.mm uses,
// written from Apple's Metal documentation (names, selectors, parameter and return types, enum
// values), for the Linux type check only (tools/metal_device_check.py). Never on an Apple build's
// include path. tests/test_metal_device_check.py checks that every selector declared here is used by
// device.mm, and on macOS that the enum values equal the SDK's. What this cannot prove is in
// docs/metal.md.
#pragma once
#import <Foundation/Foundation.h>

#ifdef __cplusplus
#define MTL_EXTERN extern "C"
#else
#define MTL_EXTERN extern
#endif

#pragma clang assume_nonnull begin

// ---- MTLTypes.h
typedef struct {
    NSUInteger width, height, depth;
} MTLSize;

static inline MTLSize MTLSizeMake(NSUInteger width, NSUInteger height, NSUInteger depth) {
    MTLSize size;
    size.width = width;
    size.height = height;
    size.depth = depth;
    return size;
}

// ---- MTLResource.h
// MTLResourceStorageModeShift = 4; MTLStorageModeShared = 0. MTLResourceHazardTrackingModeShift = 8;
// MTLHazardTrackingModeUntracked = 1
typedef NS_OPTIONS(NSUInteger, MTLResourceOptions) {
    MTLResourceStorageModeShared = 0UL << 4,
    MTLResourceHazardTrackingModeUntracked = 1UL << 8,
};

// ---- MTLAllocation.h (macOS 15)
@protocol MTLAllocation <NSObject>
@end

@protocol MTLResource <MTLAllocation>
@property (nullable, copy, atomic) NSString *label;
@end

// ---- MTLBuffer.h
@protocol MTLBuffer <MTLResource>
@property (readonly) NSUInteger length;
- (void *)contents NS_RETURNS_INNER_POINTER;
@end

// ---- MTLDevice.h (MTLGPUFamily)
typedef NS_ENUM(NSInteger, MTLGPUFamily) {
    MTLGPUFamilyApple1 = 1001,
    MTLGPUFamilyApple2 = 1002,
    MTLGPUFamilyApple3 = 1003,
    MTLGPUFamilyApple4 = 1004,
    MTLGPUFamilyApple5 = 1005,
    MTLGPUFamilyApple6 = 1006,
    MTLGPUFamilyApple7 = 1007,
    MTLGPUFamilyApple8 = 1008,
    MTLGPUFamilyApple9 = 1009,
    MTLGPUFamilyMetal3 = 5001,
};

// ---- MTLLibrary.h
@protocol MTLFunction <NSObject>
@end

// (major << 16) + minor; 3.1: macOS 14 (4.0, macOS 26, is spelled by its value: older SDKs lack it)
typedef NS_ENUM(NSUInteger, MTLLanguageVersion) {
    MTLLanguageVersion3_1 = (3 << 16) + 1,
};

@interface MTLCompileOptions : NSObject
@property (readwrite, nonatomic) BOOL fastMathEnabled;
@property (readwrite, nonatomic) MTLLanguageVersion languageVersion;
@end

@protocol MTLLibrary <NSObject>
- (nullable id<MTLFunction>)newFunctionWithName:(NSString *)functionName;
@property (readonly) NSArray<NSString *> *functionNames;
@end

// ---- MTLComputePipeline.h
@protocol MTLComputePipelineState <NSObject>
@property (readonly) NSUInteger maxTotalThreadsPerThreadgroup;
@property (readonly) NSUInteger threadExecutionWidth;
@property (readonly) NSUInteger staticThreadgroupMemoryLength;
@end

// ---- MTLCommandEncoder.h
typedef NS_OPTIONS(NSUInteger, MTLBarrierScope) {
    MTLBarrierScopeBuffers = 1 << 0,
};

@protocol MTLCommandEncoder <NSObject>
- (void)endEncoding;
@end

// ---- MTLComputeCommandEncoder.h
@protocol MTLComputeCommandEncoder <MTLCommandEncoder>
- (void)setComputePipelineState:(id<MTLComputePipelineState>)state;
- (void)setBytes:(const void *)bytes length:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)setBuffer:(nullable id<MTLBuffer>)buffer offset:(NSUInteger)offset atIndex:(NSUInteger)index;
- (void)setThreadgroupMemoryLength:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)dispatchThreadgroups:(MTLSize)threadgroupsPerGrid threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup;
- (void)memoryBarrierWithScope:(MTLBarrierScope)scope;
@end

// ---- MTLCommandBuffer.h
// (NotEnqueued 0, Enqueued 1, Committed 2, Scheduled 3, Completed 4: unused)
typedef NS_ENUM(NSUInteger, MTLCommandBufferStatus) {
    MTLCommandBufferStatusError = 5,
};

// (Serial 0: unused)
typedef NS_ENUM(NSUInteger, MTLDispatchType) {
    MTLDispatchTypeConcurrent = 1,
};

@protocol MTLCommandBuffer;
typedef void (^MTLCommandBufferHandler)(id<MTLCommandBuffer>);

@protocol MTLCommandBuffer <NSObject>
@property (readonly) MTLCommandBufferStatus status;
@property (nullable, readonly) NSError *error;
- (void)commit;
- (void)addCompletedHandler:(MTLCommandBufferHandler)block;
- (void)waitUntilCompleted;
- (nullable id<MTLComputeCommandEncoder>)computeCommandEncoderWithDispatchType:(MTLDispatchType)dispatchType;
@end

// ---- MTLResidencySet.h (macOS 15)
@interface MTLResidencySetDescriptor : NSObject
@property (nullable, copy, nonatomic) NSString *label;
@property (nonatomic) NSUInteger initialCapacity;
@end

@protocol MTLResidencySet <NSObject>
- (void)addAllocation:(id<MTLAllocation>)allocation;
- (void)removeAllocation:(id<MTLAllocation>)allocation;
- (void)commit;
- (void)requestResidency;
@end

// ---- MTLCommandQueue.h
@protocol MTLCommandQueue <NSObject>
- (nullable id<MTLCommandBuffer>)commandBuffer;
- (void)addResidencySet:(id<MTLResidencySet>)residencySet;
@end

// ---- MTLDevice.h
@protocol MTLDevice <NSObject>
@property (readonly) NSString *name;
@property (readonly) NSUInteger maxBufferLength;
@property (readonly) MTLSize maxThreadsPerThreadgroup;
@property (readonly) NSUInteger maxThreadgroupMemoryLength;
@property (readonly) BOOL hasUnifiedMemory;
@property (readonly) uint64_t recommendedMaxWorkingSetSize;
- (BOOL)supportsFamily:(MTLGPUFamily)gpuFamily;
- (nullable id<MTLCommandQueue>)newCommandQueue;
- (nullable id<MTLBuffer>)newBufferWithLength:(NSUInteger)length options:(MTLResourceOptions)options;
- (nullable id<MTLBuffer>)newBufferWithBytes:(const void *)pointer
                                      length:(NSUInteger)length
                                     options:(MTLResourceOptions)options;
- (nullable id<MTLBuffer>)newBufferWithBytesNoCopy:(void *)pointer
                                            length:(NSUInteger)length
                                           options:(MTLResourceOptions)options
                                       deallocator:(void (^_Nullable)(void *pointer, NSUInteger length))deallocator;
- (nullable id<MTLLibrary>)newLibraryWithSource:(NSString *)source
                                        options:(nullable MTLCompileOptions *)options
                                          error:(__autoreleasing NSError *_Nullable *_Nullable)error;
- (nullable id<MTLComputePipelineState>)newComputePipelineStateWithFunction:(id<MTLFunction>)computeFunction
                                                                      error:(__autoreleasing NSError *_Nullable *_Nullable)error;
- (nullable id<MTLResidencySet>)newResidencySetWithDescriptor:(MTLResidencySetDescriptor *)desc
                                                         error:(__autoreleasing NSError *_Nullable *_Nullable)error;
@end

MTL_EXTERN id<MTLDevice> _Nullable MTLCreateSystemDefaultDevice(void) NS_RETURNS_RETAINED;

#pragma clang assume_nonnull end
